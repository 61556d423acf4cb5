"""Evaluating constant subgraphs: numpy kernels for the small ops, onnxruntime for the rest.

Lives beside the passes, not in them: a pass reaches the evaluator through its context and
never imports onnxruntime itself.
"""

from graphopt.evaluate.base import EvaluationError
from graphopt.evaluate.evaluator import Evaluator

__all__ = ["EvaluationError", "Evaluator"]
