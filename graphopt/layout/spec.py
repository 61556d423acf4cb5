"""Layout problems as JSON (schemas/unwind.schema.json), read into a :class:`Problem`.

    {"ops": [{"op": "Sink", "id": "A", "shape": [5]},
             {"op": "Source", "id": "B", "shape": [5]}],
     "pairs": [{"a": "A", "b": "B", "value": 5}]}

The same object may be the ``layout`` section of a graphopt JSON graph. Every error,
of form or of meaning (an unknown tensor, shapes that do not fit, a problem over the size
limits), names its JSON path. The limits are checked before anything is allocated: a
problem of a few bytes may claim tensors of 2**62 elements.
"""

from __future__ import annotations

import math
from typing import Any

from graphopt.errors import InputError
from graphopt.layout.problem import Problem, ProblemError
from graphopt.schemas import validate

__all__ = ["MAX_ELEMENTS", "MAX_ENTRIES", "MAX_RANK", "problem_from_json", "problem_to_json"]

# A problem read from JSON holds at most this many elements over the tensors that have
# their own (sinks, sources, the outputs of fixed points, barriers, reductions and calls)
# and in any one tensor (a 700 x 700 sink paired with a source, 980,000 elements, takes
# 460 MB to solve). The unwind pass's own problems are far smaller (a proxy of at most 64
# elements per value).
MAX_ELEMENTS = 1 << 20
# The most axes a tensor of a problem has (numpy's arrays have at most 64).
MAX_RANK = 32
# The most ops and pairs, together, of a problem read from JSON: the schema check takes about
# half a millisecond for each, so a bigger problem would spend the solver's default budget
# before the solver starts.
MAX_ENTRIES = 10_000


def problem_from_json(data: Any, where: str, path: str = "$") -> Problem:
    """Build the problem ``data`` describes; ``where`` (the file) and ``path`` (the JSON path
    of ``data`` in it) prefix every error message."""
    entries = [data.get(key) for key in ("ops", "pairs")] if isinstance(data, dict) else []
    count = sum(len(found) for found in entries if isinstance(found, list))
    if count > MAX_ENTRIES:
        raise InputError(f"{where}: {path}: {count} ops and pairs; a problem read from JSON has at most {MAX_ENTRIES}")
    try:
        validate(data, "unwind", where)
    except InputError as err:
        raise InputError(str(err).replace(f"{where}: $", f"{where}: {path}", 1)) from None
    problem = Problem()
    for i, entry in enumerate(data["ops"]):
        try:
            _check_size(problem, entry)
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


def _check_size(problem: Problem, op: dict[str, Any]) -> None:
    """Refuse ``op`` when a tensor it makes would pass :data:`MAX_RANK` or :data:`MAX_ELEMENTS`,
    or the elements of the problem's origin tensors would pass :data:`MAX_ELEMENTS` with it."""
    kind = op["op"]
    shapes = [o["shape"] for o in op["outs"]] if kind in ("FixedPoint", "Barrier") else []
    if "shape" in op:
        shapes.append(op["shape"])
    if kind == "Call":  # its outputs are new sinks of the callee outputs' shapes
        shapes += [list(problem.shapes[out]) for out in op["callee_outs"] if out in problem.shapes]
    if kind == "Concat":
        shapes.append([sum(math.prod(problem.shapes[x]) for x in op["ins"] if x in problem.shapes)])
    for shape in shapes:
        if len(shape) > MAX_RANK:
            raise ProblemError(f"a shape of rank {len(shape)}; a problem's tensors have at most {MAX_RANK} axes")
        if math.prod(shape) > MAX_ELEMENTS:
            raise ProblemError(
                f"a tensor of {math.prod(shape)} elements; a problem's tensors have at most {MAX_ELEMENTS}"
            )
    if kind in ("Sink", "Source", "FixedPoint", "Barrier", "SumLikeReduce", "Call"):
        made = sum(math.prod(shape) for shape in shapes)
        if problem.slot_count + made > MAX_ELEMENTS:
            raise ProblemError(
                f"the problem would hold {problem.slot_count + made} elements in its sinks, sources and other"
                f" origins; at most {MAX_ELEMENTS}"
            )


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
