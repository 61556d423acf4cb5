"""Layout problems as JSON (schemas/unwind.schema.json), read into a :class:`Problem`.

    {"ops": [{"op": "Sink", "id": "A", "shape": [5]},
             {"op": "Source", "id": "B", "shape": [5]}],
     "pairs": [{"a": "A", "b": "B", "value": 5}]}

The same object may be the ``layout`` section of a graphopt JSON graph. Every error,
of form or of meaning (an unknown tensor, shapes that do not fit), names its JSON path.
"""

from __future__ import annotations

from typing import Any

from graphopt.errors import InputError
from graphopt.passes.unwind.problem import Problem, ProblemError
from graphopt.schemas import validate

__all__ = ["problem_from_json"]


def problem_from_json(data: Any, where: str, path: str = "$") -> Problem:
    """Build the problem ``data`` describes; ``where`` (the file) and ``path`` (the JSON path
    of ``data`` in it) prefix every error message."""
    try:
        validate(data, "unwind", where)
    except InputError as err:
        raise InputError(str(err).replace(f"{where}: $", f"{where}: {path}", 1)) from None
    problem = Problem()
    for i, entry in enumerate(data["ops"]):
        try:
            _add(problem, entry)
        except ProblemError as err:
            raise InputError(f"{where}: {path}.ops[{i}]: {err}") from None
    for i, entry in enumerate(data.get("pairs", [])):
        try:
            problem.pair(entry["a"], entry["b"], entry["value"])
        except ProblemError as err:
            raise InputError(f"{where}: {path}.pairs[{i}]: {err}") from None
    return problem


def _add(problem: Problem, op: dict[str, Any]) -> None:
    kind = op["op"]
    if kind == "Sink":
        problem.sink(op["shape"], op["id"])
    elif kind == "Source":
        problem.source(op["shape"], op["id"])
    elif kind in ("FixedPoint", "Barrier"):
        build = problem.fixed_point if kind == "FixedPoint" else problem.barrier
        build(op["ins"], [o["shape"] for o in op["outs"]], [o["id"] for o in op["outs"]])
    elif kind == "DimShuffle":
        problem.dim_shuffle(op["in"], op["perm"], op["id"])
    elif kind == "Reverse":
        problem.reverse(op["in"], op["axes"], op["id"])
    elif kind == "Reshape":
        problem.reshape(op["in"], op["shape"], op["id"])
    elif kind == "Slice":
        problem.slice(op["in"], op["starts"], op["ends"], op.get("steps"), op["id"])
    elif kind == "SubSample":
        problem.sub_sample(op["in"], op["steps"], op["id"])
    elif kind == "Concat":
        problem.concat(op["ins"], op["axis"], op["id"])
    elif kind == "Expand":
        problem.expand(op["in"], op["shape"], op["id"])
    elif kind == "Identity":
        problem.identity(op["in"], op["id"])
    elif kind == "SumLike":
        problem.sum_like(op["ins"], op.get("unwind_index", 0), op["id"])
    elif kind == "SumLikeReduce":
        problem.sum_like_reduce(op["in"], op["shape"], op["id"])
    else:  # Call: the schema admits nothing else
        problem.call(op["ins"], op["callee_ins"], op["callee_outs"], op["value"], op["outs"])
