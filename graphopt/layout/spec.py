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
from graphopt.layout.problem import Problem, ProblemError
from graphopt.schemas import validate

__all__ = ["problem_from_json", "problem_to_json"]


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


# The Problem method each spec op kind calls, with the op's fields in argument order
# (a trailing "?" marks an optional field).
_BUILDERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Sink": ("sink", ("shape", "id")),
    "Source": ("source", ("shape", "id")),
    "DimShuffle": ("dim_shuffle", ("in", "perm", "id")),
    "Reverse": ("reverse", ("in", "axes", "id")),
    "Reshape": ("reshape", ("in", "shape", "id")),
    "Slice": ("slice", ("in", "starts", "ends", "steps?", "id")),
    "SubSample": ("sub_sample", ("in", "steps", "id")),
    "Concat": ("concat", ("ins", "axis", "id")),
    "Expand": ("expand", ("in", "shape", "id")),
    "Identity": ("identity", ("in", "id")),
    "SumLike": ("sum_like", ("ins", "unwind_index?", "id")),
    "SumLikeReduce": ("sum_like_reduce", ("in", "shape", "id")),
    "Call": ("call", ("ins", "callee_ins", "callee_outs", "value", "outs")),
}
_OPTIONAL_DEFAULTS = {"unwind_index": 0}


def _add(problem: Problem, op: dict[str, Any]) -> None:
    kind = op["op"]
    if kind in ("FixedPoint", "Barrier"):
        build = problem.fixed_point if kind == "FixedPoint" else problem.barrier
        build(op["ins"], [o["shape"] for o in op["outs"]], [o["id"] for o in op["outs"]])
        return
    method, fields = _BUILDERS[kind]  # the schema admits no other kind
    arguments = [op.get(f[:-1], _OPTIONAL_DEFAULTS.get(f[:-1])) if f.endswith("?") else op[f] for f in fields]
    getattr(problem, method)(*arguments)


# The spec op of each recorded Problem op kind, with the JSON fields of its parameters.
_SPEC_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    method: (spec, tuple(f.rstrip("?") for f in fields if f not in ("in", "ins", "id")))
    for spec, (method, fields) in _BUILDERS.items()
    if spec != "Call"  # a call is recorded as the sinks and pairs it makes
}


def problem_to_json(problem: Problem) -> dict[str, Any]:
    """``problem`` as the JSON :func:`problem_from_json` reads back (the same ids, ops, pairs)."""
    ops: list[dict[str, Any]] = []
    for op in problem.ops:
        if op.kind in ("fixed_point", "barrier"):
            outs = [{"id": out, "shape": shape} for out, shape in zip(op.outs, op.params["shapes"])]
            kind = "FixedPoint" if op.kind == "fixed_point" else "Barrier"
            ops.append({"op": kind, "ins": list(op.ins), "outs": outs})
            continue
        spec, fields = _SPEC_OPS[op.kind]
        entry: dict[str, Any] = {"op": spec, "id": op.outs[0]}
        if op.kind in ("concat", "sum_like"):
            entry["ins"] = list(op.ins)
        elif op.ins:
            entry["in"] = op.ins[0]
        for name in fields:
            value = op.params.get(name)
            if value is not None:
                entry[name] = [int(v) for v in value] if isinstance(value, (list, tuple)) else value
        ops.append(entry)
    pairs = [{"a": pair.a, "b": pair.b, "value": pair.value} for pair in problem.pairs]
    return {"ops": ops, "pairs": pairs}
