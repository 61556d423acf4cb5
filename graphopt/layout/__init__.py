"""The layout problem and its solvers: choose the layouts of tensors to maximize an element-wise objective.

:mod:`problem` is the layout problem (sinks, sources, views, barriers, valued pairs), :mod:`solvers`
solves it, :mod:`solution` reports the answer, :mod:`spec` reads the JSON form
(schemas/unwind.schema.json). It knows no IR: the unwind pass (graphopt.passes.unwind) derives the
problem of an ONNX model and writes its answer back; `graphopt unwind` solves a problem file.
"""

from graphopt.layout.problem import Pair, Problem, ProblemError
from graphopt.layout.solution import Run, Solution
from graphopt.layout.solvers import SOLVERS, solve
from graphopt.layout.spec import problem_from_json

__all__ = ["SOLVERS", "Pair", "Problem", "ProblemError", "Run", "Solution", "problem_from_json", "solve"]
