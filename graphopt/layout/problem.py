"""The layout problem: tensors whose elements carry mappings, ops that relate them, valued pairs.

Every element of every tensor has a *mapping* (an opaque label: a tile, a memory slot).
A problem is built op by op, in order (an op may read only tensors built before it):

- ``sink`` tensors are the unknowns; the solver gives each element any mapping;
- ``source`` tensors have known, distinct mappings; so do the outputs of a ``fixed_point``
  (known from the start, whatever its inputs) and of a ``barrier`` (known only once every
  element of every input has a mapping, and never usable upstream of it);
- view ops relate input and output elements one to one: ``dim_shuffle``, ``reverse``,
  ``reshape``, ``slice`` (``sub_sample`` is a slice with steps), ``concat``, ``expand``
  (one input element to many), ``identity``. Unwinding walks them backwards through their
  inverses (DimShuffle by the inverse permutation, Reverse by itself, Reshape by Reshape,
  Concat by Slice, Slice and SubSample by SettFillInto: a write into a sub-region);
- ``sum_like`` is element-wise: its output has the mapping of input ``unwind_index``;
- ``sum_like_reduce(x, shape)`` is a barrier whose output element takes the mapping of
  the first element of ``x`` (row-major) that broadcasts onto it;
- ``call`` copies tensors into a subgraph's input sinks and its outputs into new sinks,
  with a valued pair per copy;
- ``pair(a, b, v)``: a and b have equal shapes; each index where their mappings agree is
  worth ``v``.

**The objective** is the seed's loop, ``sum(p.v * (mapping(a)[i] == mapping(b)[i]))`` over
pairs and row-major indices; the **upper bound** is ``sum(p.v * elements)``.

How it is computed: every tensor is a gather of *slots*. A slot is one element of an
origin tensor (a sink, a source, a fixed point's or a barrier's output); a view's element
is the slot of the input element it views. A sink slot's label is the solver's choice,
any other slot's label is its own id. A ``sum_like_reduce`` output gets its own slots for
the order of events (it exists only after ``x`` is complete), each an alias of the ``x``
slot it copies. Evaluating an assignment is then one gather and compare per pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Op", "Pair", "Problem", "ProblemError"]

Shape = tuple[int, ...]

# Slot kinds.
SINK, FIXED, ALIAS = 0, 1, 2

VIEW_OPS = ("dim_shuffle", "reverse", "reshape", "slice", "sub_sample", "concat", "expand", "identity")


class ProblemError(ValueError):
    """An op or pair that does not fit the problem (unknown tensor, wrong shape, ...)."""


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    value: float


@dataclass(frozen=True)
class Op:
    """One op as it was added: its kind, inputs, outputs and parameters (plain values)."""

    kind: str
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict, hash=False)


class Problem:
    """A layout problem, built op by op. Every builder method returns the new tensor's id."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.pairs: list[Pair] = []
        self.shapes: dict[str, Shape] = {}
        self.sinks: list[str] = []
        # Slots: the origin tensor and flat index of each, its kind, and for an alias the
        # slot it copies (resolved to a non-alias slot).
        self._slot_tensor: list[str] = []
        self._slot_index: list[int] = []
        self._slot_kind: list[int] = []
        self._alias_of: dict[int, int] = {}
        self.base: dict[str, int] = {}
        self.ref: dict[str, np.ndarray] = {}
        # Barrier-like origins (barrier and sum_like_reduce outputs): the tensors that must be
        # complete before their slots have mappings.
        self.gates: dict[str, tuple[str, ...]] = {}
        # Sink -> the barrier outputs downstream of it (their mappings depend on the sink).
        self.forbidden: dict[str, set[str]] = {}
        self._producer: dict[str, Op] = {}
        self._names = 0

    # -- tensors and slots --------------------------------------------------------------
    def _new_id(self, out: str | None, kind: str) -> str:
        if out is None:
            while True:
                self._names += 1
                out = f"{kind}{self._names}"
                if out not in self.shapes:
                    break
        if not out:
            raise ProblemError("a tensor id must be a non-empty string")
        if out in self.shapes:
            raise ProblemError(f"tensor {out!r} is defined twice")
        return out

    def _shape(self, tensor: str) -> Shape:
        if tensor not in self.shapes:
            raise ProblemError(f"unknown tensor {tensor!r}")
        return self.shapes[tensor]

    def _origin(self, out: str, shape: Sequence[int], slot_kind: int) -> None:
        shape = _checked_shape(shape)
        size = math.prod(shape)
        base = len(self._slot_kind)
        self.base[out] = base
        self._slot_tensor.extend([out] * size)
        self._slot_index.extend(range(size))
        self._slot_kind.extend([slot_kind] * size)
        self.shapes[out] = shape
        self.ref[out] = np.arange(base, base + size, dtype=np.int64).reshape(shape)

    def _view(self, out: str, ref: np.ndarray) -> None:
        self.shapes[out] = tuple(int(d) for d in ref.shape)
        self.ref[out] = ref

    def _record(self, kind: str, ins: Sequence[str], outs: Sequence[str], **params: Any) -> None:
        op = Op(kind, tuple(ins), tuple(outs), params)
        self.ops.append(op)
        for out in outs:
            self._producer[out] = op

    @property
    def slot_count(self) -> int:
        return len(self._slot_kind)

    def slot_kinds(self) -> np.ndarray:
        return np.array(self._slot_kind, dtype=np.int8)

    def slot_origin(self, slot: int) -> tuple[str, int]:
        return self._slot_tensor[slot], self._slot_index[slot]

    def resolved(self, tensor: str) -> np.ndarray:
        """The tensor's slots with aliases replaced by the slots they copy."""
        ref = self.ref[tensor]
        if not self._alias_of:
            return ref
        lookup = np.arange(self.slot_count, dtype=np.int64)
        for alias, target in self._alias_of.items():
            lookup[alias] = target
        return lookup[ref]

    def alias_targets(self) -> dict[int, int]:
        return dict(self._alias_of)

    # -- inputs ---------------------------------------------------------------------------
    def sink(self, shape: Sequence[int], out: str | None = None) -> str:
        out = self._new_id(out, "sink")
        self._origin(out, shape, SINK)
        self.sinks.append(out)
        self._record("sink", (), (out,), shape=list(self.shapes[out]))
        return out

    def source(self, shape: Sequence[int], out: str | None = None) -> str:
        out = self._new_id(out, "source")
        self._origin(out, shape, FIXED)
        self._record("source", (), (out,), shape=list(self.shapes[out]))
        return out

    def fixed_point(
        self, ins: Sequence[str], shapes: Sequence[Sequence[int]], outs: Sequence[str] | None = None
    ) -> list[str]:
        return self._opaque("fixed_point", ins, shapes, outs)

    def barrier(
        self, ins: Sequence[str], shapes: Sequence[Sequence[int]], outs: Sequence[str] | None = None
    ) -> list[str]:
        return self._opaque("barrier", ins, shapes, outs)

    def _opaque(
        self, kind: str, ins: Sequence[str], shapes: Sequence[Sequence[int]], outs: Sequence[str] | None
    ) -> list[str]:
        for tensor in ins:
            self._shape(tensor)
        if outs is not None and len(outs) != len(shapes):
            raise ProblemError(f"{kind}: {len(outs)} output ids for {len(shapes)} shapes")
        made = [self._new_id(outs[i] if outs is not None else None, kind) for i in range(len(shapes))]
        if len(set(made)) != len(made):
            raise ProblemError(f"{kind}: output ids repeat")
        for out, shape in zip(made, shapes):
            self._origin(out, shape, FIXED)
            if kind == "barrier":
                self.gates[out] = tuple(ins)
        if kind == "barrier":
            for sink in self._upstream_sinks(ins):
                self.forbidden.setdefault(sink, set()).update(made)
        self._record(kind, ins, made, shapes=[list(self.shapes[o]) for o in made])
        return made

    def _upstream_sinks(self, tensors: Sequence[str]) -> set[str]:
        found: set[str] = set()
        seen: set[str] = set()
        pending = list(tensors)
        while pending:
            tensor = pending.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            op = self._producer[tensor]
            if op.kind == "sink":
                found.add(tensor)
            pending.extend(op.ins)
        return found

    # -- views ----------------------------------------------------------------------------
    def dim_shuffle(self, x: str, perm: Sequence[int], out: str | None = None) -> str:
        rank = len(self._shape(x))
        perm = [int(p) for p in perm]
        if sorted(perm) != list(range(rank)):
            raise ProblemError(f"dim_shuffle: {perm} is not a permutation of {rank} axes")
        out = self._new_id(out, "dim_shuffle")
        self._view(out, self.ref[x].transpose(perm))
        self._record("dim_shuffle", (x,), (out,), perm=perm)
        return out

    def reverse(self, x: str, axes: Sequence[int], out: str | None = None) -> str:
        axes = [_axis(a, len(self._shape(x)), "reverse") for a in axes]
        out = self._new_id(out, "reverse")
        self._view(out, np.flip(self.ref[x], axis=tuple(axes)) if axes else self.ref[x])
        self._record("reverse", (x,), (out,), axes=axes)
        return out

    def reshape(self, x: str, shape: Sequence[int], out: str | None = None) -> str:
        shape = _checked_shape(shape)
        if math.prod(shape) != math.prod(self._shape(x)):
            raise ProblemError(f"reshape: {list(self._shape(x))} and {list(shape)} differ in size")
        out = self._new_id(out, "reshape")
        self._view(out, self.ref[x].reshape(shape))
        self._record("reshape", (x,), (out,), shape=list(shape))
        return out

    def slice(
        self,
        x: str,
        starts: Sequence[int],
        ends: Sequence[int],
        steps: Sequence[int] | None = None,
        out: str | None = None,
    ) -> str:
        shape = self._shape(x)
        steps = list(steps) if steps is not None else [1] * len(shape)
        if not len(starts) == len(ends) == len(steps) == len(shape):
            raise ProblemError(f"slice: starts, ends and steps need one entry per axis ({len(shape)})")
        if any(s < 1 for s in steps):
            raise ProblemError(f"slice: steps must be positive, got {list(steps)}")
        index = tuple(slice(int(b), int(e), int(s)) for b, e, s in zip(starts, ends, steps))
        out = self._new_id(out, "slice")
        self._view(out, self.ref[x][index])
        self._record("slice", (x,), (out,), starts=list(starts), ends=list(ends), steps=steps)
        return out

    def sub_sample(self, x: str, steps: Sequence[int], out: str | None = None) -> str:
        shape = self._shape(x)
        if len(steps) != len(shape) or any(s < 1 for s in steps):
            raise ProblemError(f"sub_sample: steps need one positive entry per axis ({len(shape)})")
        out = self._new_id(out, "sub_sample")
        self._view(out, self.ref[x][tuple(slice(None, None, int(s)) for s in steps)])
        self._record("sub_sample", (x,), (out,), steps=list(steps))
        return out

    def concat(self, xs: Sequence[str], axis: int, out: str | None = None) -> str:
        if not xs:
            raise ProblemError("concat: needs at least one input")
        rank = len(self._shape(xs[0]))
        axis = _axis(axis, rank, "concat")
        shapes = [self._shape(x) for x in xs]
        if any(len(s) != rank or s[:axis] + s[axis + 1 :] != shapes[0][:axis] + shapes[0][axis + 1 :] for s in shapes):
            raise ProblemError(f"concat: shapes {[list(s) for s in shapes]} do not concatenate on axis {axis}")
        out = self._new_id(out, "concat")
        self._view(out, np.concatenate([self.ref[x] for x in xs], axis=axis))
        self._record("concat", tuple(xs), (out,), axis=axis)
        return out

    def expand(self, x: str, shape: Sequence[int], out: str | None = None) -> str:
        shape = _checked_shape(shape)
        if not _broadcasts(self._shape(x), shape):
            raise ProblemError(f"expand: {list(self._shape(x))} does not broadcast to {list(shape)}")
        ref = np.broadcast_to(self.ref[x], shape)
        out = self._new_id(out, "expand")
        self._view(out, ref)
        self._record("expand", (x,), (out,), shape=list(shape))
        return out

    def identity(self, x: str, out: str | None = None) -> str:
        self._shape(x)
        out = self._new_id(out, "identity")
        self._view(out, self.ref[x])
        self._record("identity", (x,), (out,))
        return out

    # -- element-wise ----------------------------------------------------------------------
    def sum_like(self, xs: Sequence[str], unwind_index: int = 0, out: str | None = None) -> str:
        if not 0 <= unwind_index < len(xs):
            raise ProblemError(f"sum_like: unwind_index {unwind_index} is not one of {len(xs)} inputs")
        target = self._shape(xs[unwind_index])
        for x in xs:
            if not _broadcasts(self._shape(x), target):
                raise ProblemError(
                    f"sum_like: {x!r} {list(self._shape(x))} does not broadcast to the unwound input's {list(target)}"
                )
        out = self._new_id(out, "sum_like")
        self._view(out, self.ref[xs[unwind_index]])
        self._record("sum_like", tuple(xs), (out,), unwind_index=unwind_index)
        return out

    def sum_like_reduce(self, x: str, shape: Sequence[int], out: str | None = None) -> str:
        shape = _checked_shape(shape)
        big = self._shape(x)
        if not _broadcasts(shape, big):
            raise ProblemError(f"sum_like_reduce: {list(shape)} does not broadcast to {list(big)}")
        out = self._new_id(out, "sum_like_reduce")
        self._origin(out, shape, ALIAS)
        self.gates[out] = (x,)
        # The first element of x (row-major) that broadcasts onto each output element: index
        # 0 on x's leading axes and on the axes the output broadcasts (size 1).
        lead = len(big) - len(shape)
        index = tuple([0] * lead + [slice(None) if s == b else slice(0, 1) for s, b in zip(shape, big[lead:])])
        copied = self.resolved(x)[index].reshape(shape)
        for slot, target in zip(self.ref[out].ravel().tolist(), copied.ravel().tolist()):
            self._alias_of[slot] = target
        self._record("sum_like_reduce", (x,), (out,), shape=list(shape))
        return out

    # -- pairs and calls -----------------------------------------------------------------
    def pair(self, a: str, b: str, value: float) -> None:
        if self._shape(a) != self._shape(b):
            raise ProblemError(f"pair: {a!r} {list(self._shape(a))} and {b!r} {list(self._shape(b))} differ in shape")
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ProblemError(f"pair: the value per element must be a finite number >= 0, not {value!r}")
        self.pairs.append(Pair(a, b, float(value)))

    def call(
        self,
        ins: Sequence[str],
        callee_ins: Sequence[str],
        callee_outs: Sequence[str],
        value: float,
        outs: Sequence[str] | None = None,
    ) -> list[str]:
        """Copy ``ins`` into the callee's input sinks and its outputs into new sinks (returned),
        with one valued pair per copy."""
        if len(ins) != len(callee_ins):
            raise ProblemError(f"call: {len(ins)} arguments for {len(callee_ins)} callee inputs")
        if outs is not None and len(outs) != len(callee_outs):
            raise ProblemError(f"call: {len(outs)} output ids for {len(callee_outs)} callee outputs")
        for callee_in in callee_ins:
            if self._producer.get(callee_in, Op("", (), ())).kind != "sink":
                raise ProblemError(f"call: callee input {callee_in!r} is not a sink")
        for arg, callee_in in zip(ins, callee_ins):
            self.pair(arg, callee_in, value)
        made = []
        for i, callee_out in enumerate(callee_outs):
            made.append(self.sink(self._shape(callee_out), outs[i] if outs is not None else None))
            self.pair(callee_out, made[-1], value)
        return made

    # -- the objective ----------------------------------------------------------------------
    @property
    def upper_bound(self) -> float:
        return float(sum(p.value * math.prod(self.shapes[p.a]) for p in self.pairs))

    def labels_of(self, sink_labels: np.ndarray) -> np.ndarray:
        """The label of every slot, given the labels of all slots (only sink entries are read)."""
        labels = np.arange(self.slot_count, dtype=np.int64)
        kinds = self.slot_kinds()
        sink_slots = kinds == SINK
        labels[sink_slots] = sink_labels[sink_slots]
        for alias, target in self._alias_of.items():
            labels[alias] = labels[target]
        return labels

    def objective(self, sink_labels: np.ndarray) -> float:
        labels = self.labels_of(sink_labels)
        total = 0.0
        for pair in self.pairs:
            same = labels[self.ref[pair.a]] == labels[self.ref[pair.b]]
            total += pair.value * int(np.count_nonzero(same))
        return total


def _checked_shape(shape: Sequence[int]) -> Shape:
    dims = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ProblemError(f"a shape is a list of non-negative integers, not {list(dims)}")
    return tuple(int(d) for d in dims)


def _axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < rank:
        raise ProblemError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def _broadcasts(small: Shape, big: Shape) -> bool:
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(reversed(small), reversed(big)))
