"""An evaluator and an exhaustive search for layout problems, written apart from the solver.

Both read only what a user sees: the ops as recorded (``problem.ops``), the pairs, and a
solution's run-length layouts. Mappings are plain tuples propagated op by op with numpy
object arrays, and the objective is the seed's loop, element by element.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from graphopt.layout import Problem


def _object_array(items: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        array[i] = item
    return array.reshape(shape)


def propagate(problem: Problem, sink_mappings: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """Every tensor's mappings, given each sink's (row-major list)."""
    tensors: dict[str, np.ndarray] = {}
    for op in problem.ops:
        p = op.params
        if op.kind == "sink":
            (out,) = op.outs
            tensors[out] = _object_array(list(sink_mappings[out]), tuple(p["shape"]))
        elif op.kind in ("source", "fixed_point", "barrier"):
            shapes = [p["shape"]] if op.kind == "source" else p["shapes"]
            for out, shape in zip(op.outs, shapes):
                tensors[out] = _object_array([(out, i) for i in range(math.prod(shape))], tuple(shape))
        elif op.kind == "dim_shuffle":
            tensors[op.outs[0]] = tensors[op.ins[0]].transpose(p["perm"])
        elif op.kind == "reverse":
            x = tensors[op.ins[0]]
            for axis in p["axes"]:
                x = np.flip(x, axis)
            tensors[op.outs[0]] = x
        elif op.kind == "reshape":
            tensors[op.outs[0]] = tensors[op.ins[0]].reshape(p["shape"])
        elif op.kind == "slice":
            index = tuple(slice(b, e, s) for b, e, s in zip(p["starts"], p["ends"], p["steps"]))
            tensors[op.outs[0]] = tensors[op.ins[0]][index]
        elif op.kind == "sub_sample":
            tensors[op.outs[0]] = tensors[op.ins[0]][tuple(slice(None, None, s) for s in p["steps"])]
        elif op.kind == "concat":
            tensors[op.outs[0]] = np.concatenate([tensors[x] for x in op.ins], axis=p["axis"])
        elif op.kind == "expand":
            tensors[op.outs[0]] = np.broadcast_to(tensors[op.ins[0]], p["shape"])
        elif op.kind == "identity":
            tensors[op.outs[0]] = tensors[op.ins[0]]
        elif op.kind == "sum_like":
            tensors[op.outs[0]] = tensors[op.ins[p["unwind_index"]]]
        elif op.kind == "sum_like_reduce":
            x = tensors[op.ins[0]]
            shape = tuple(p["shape"])
            out = np.empty(shape, dtype=object)
            done = np.zeros(shape, dtype=bool)
            for index in np.ndindex(*x.shape):  # row-major: the first element to land wins
                aligned = index[len(index) - len(shape) :]
                target = tuple(0 if s == 1 else i for s, i in zip(shape, aligned))
                if not done[target]:
                    out[target] = x[index]
                    done[target] = True
            tensors[op.outs[0]] = out
        else:
            raise AssertionError(f"unknown op {op.kind}")
    return tensors


def objective(problem: Problem, tensors: dict[str, np.ndarray]) -> float:
    score = 0.0
    for pair in problem.pairs:
        a, b = tensors[pair.a].ravel(), tensors[pair.b].ravel()
        for i in range(a.size):
            score += pair.value * (a[i] == b[i])
    return score


def sink_mappings(layouts: dict[str, list[dict[str, Any]]]) -> dict[str, list[Any]]:
    """Decode a solution's run-length layouts into one mapping per sink element."""
    decoded: dict[str, list[Any]] = {}
    for sink, runs in layouts.items():
        items: list[Any] = []
        for run in runs:
            assert run["at"] == len(items)
            items.extend((run["source"], run["index"] + k * run["step"]) for k in range(run["count"]))
        decoded[sink] = items
    return decoded


def evaluate(problem: Problem, layouts: dict[str, list[dict[str, Any]]]) -> float:
    return objective(problem, propagate(problem, sink_mappings(layouts)))


def _upstream_sinks(problem: Problem, tensor: str) -> set[str]:
    producers = {out: op for op in problem.ops for out in op.outs}
    found, pending, seen = set(), [tensor], set()
    while pending:
        t = pending.pop()
        if t in seen:
            continue
        seen.add(t)
        op = producers[t]
        if op.kind == "sink":
            found.add(t)
        pending.extend(op.ins)
    return found


def exhaustive(problem: Problem, limit: int = 200_000) -> float | None:
    """The best objective over every assignment of candidate mappings to sink elements, or
    None when there are more than ``limit`` assignments to try.

    A sink element may take any fixed mapping that reaches its group (the elements linked
    to it by pairs), or the group's one shared fresh mapping; a barrier's outputs are not
    candidates for the sinks it depends on.
    """
    variables = [(sink, i) for sink in problem.sinks for i in range(math.prod(problem.shapes[sink]))]
    symbolic = propagate(
        problem, {s: [("var", s, i) for i in range(math.prod(problem.shapes[s]))] for s in problem.sinks}
    )
    links = [
        (a, b, pair.value)
        for pair in problem.pairs
        for a, b in zip(symbolic[pair.a].ravel().tolist(), symbolic[pair.b].ravel().tolist())
    ]
    group = {v: v for v in variables}

    def root(v: Any) -> Any:
        while group[v] != v:
            v = group[v]
        return v

    for a, b, _ in links:
        if a[0] == "var" and b[0] == "var":
            ra, rb = root(a[1:]), root(b[1:])
            if ra != rb:
                group[ra] = rb
    reaching: dict[Any, set[Any]] = {root(v): set() for v in variables}
    for a, b, _ in links:
        for mine, other in ((a, b), (b, a)):
            if mine[0] == "var" and other[0] != "var":
                reaching[root(mine[1:])].add(other)
    barriers = {out for op in problem.ops if op.kind == "barrier" for out in op.outs}
    domains = []
    for v in variables:
        banned = {b for b in barriers if v[0] in _upstream_sinks(problem, b)}
        options = [m for m in sorted(reaching[root(v)]) if m[0] not in banned]
        domains.append([*options, ("fresh", root(v))])
    if math.prod(len(d) for d in domains) > limit:
        return None
    position = {v: k for k, v in enumerate(variables)}
    best = -1.0
    for assignment in itertools.product(*domains):
        labels = [
            (
                assignment[position[a[1:]]] if a[0] == "var" else a,
                assignment[position[b[1:]]] if b[0] == "var" else b,
                w,
            )
            for a, b, w in links
        ]
        best = max(best, sum(w for x, y, w in labels if x == y))
    return best
