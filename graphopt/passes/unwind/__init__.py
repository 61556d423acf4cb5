"""The unwind family: choose tensor layouts to maximize the layout objective.

:mod:`problem` is the layout problem (sinks, sources, views, barriers, valued pairs),
:mod:`solvers` solves it, :mod:`solution` reports the answer, :mod:`spec` reads the JSON
form (schemas/unwind.schema.json); :mod:`onnx_layouts` derives the problem of an ONNX
model, :mod:`rewrite` writes its answer back, :mod:`layout_pass` is the ``unwind`` pass.
"""

from graphopt.passes.unwind.layout_pass import Unwind
from graphopt.passes.unwind.problem import Pair, Problem, ProblemError
from graphopt.passes.unwind.solution import Run, Solution
from graphopt.passes.unwind.solvers import SOLVERS, solve
from graphopt.passes.unwind.spec import problem_from_json

__all__ = ["SOLVERS", "Pair", "Problem", "ProblemError", "Run", "Solution", "Unwind", "problem_from_json", "solve"]
