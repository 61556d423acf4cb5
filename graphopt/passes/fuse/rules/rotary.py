"""Rotary family: rotate-half and interleaved rotary embeddings, full or partial -> RotaryEmbedding (opset 23).

The exporters write RoPE on a (batch, heads, seq, head size) tensor ``x`` as::

    x * cos + Concat(-x[..., d/2:], x[..., :d/2], axis=-1) * sin

with ``cos`` / ``sin`` of shape (batch, 1, seq, d) whose two halves are equal (Llama's
``cat(freqs, freqs)``). That is ``RotaryEmbedding(x, cos_cache, sin_cache[, position_ids])``
with the default non-interleaved full rotation: ``real = cos * x1 - sin * x2``, ``imag =
sin * x1 + cos * x2``, the caches holding one half. Where ``cos`` is a constant table
gathered by position ids and unsqueezed over the heads (``table[pos][:, None]``), the
caches are the tables' halves and the ids go to position_ids (int64, as the op wants); where
it is computed at run time, the caches are its first half (a Slice, one per cos / sin,
shared by the layers), which the check proves equal to the second: the value is a
constant with equal halves, or an element-wise function (Cos, Sin, Cast, a scalar scale) of
``Concat(f, f)`` along the last axis. onnxruntime wants the caches' batch spelled out, so
a cos that broadcasts over the batch is refused unless the batch is static.

Interleaved (GPT-J's ``rotate_every_two``): ``x * cos + Reshape(Concat(Unsqueeze(-x[..., 1::2]),
Unsqueeze(x[..., ::2]), axis=-1), x's shape) * sin`` with ``cos = repeat_interleave(c, 2)`` along
the last axis is ``RotaryEmbedding`` with ``interleaved=1`` and the caches ``c`` (of a constant
table, its even entries where each pair is equal). Partial rotation (Phi, GPT-NeoX, GPT-J's
``rotary_dim``): ``Concat(rope(whole[..., :r]), whole[..., r:])`` is the op on ``whole`` with
``rotary_embedding_dim=r``. An x of (batch, heads, seq, d) is the op's 4-D input; an x of
(batch, seq, heads, d) with cos (batch, seq, 1, d) (GPT-J rotates before its head transpose)
goes through the op's 3-D form: reshaped to (batch, seq, heads * d), ``num_heads``, and back.

For ``--target ort`` the same pattern and plan give onnxruntime's
``com.microsoft RotaryEmbedding(x, position_ids, cos_cache, sin_cache)`` on the 4-D
(batch, heads, seq, head size) x. Its CPU kernel wants 2-D (max position, d/2) caches indexed
by (batch, seq) int64 position ids (or by one offset shared by the batch), so:

- a constant table gathered by position ids keeps its half table and the ids;
- a constant (batch, seq, d/2) cache is flattened to (batch * seq, d/2), the ids counting its rows;
- a run-time (batch, seq, d/2) cache (cos / sin computed from the ids) likewise, the ids
  ``Range(0, batch * seq)`` reshaped to (batch, seq), the count read from the cache's shape;
- a run-time (1, seq, d/2) cache shared by the batch is flattened to (seq, d/2), the ids the offset 0.

The flattening and the ids are made once per cache and shared by the layers. The kernel runs
float32 and float16, with the caches in x's type. On a float16 x at opset 23 ``rotary-embedding-float32`` (late)
computes the op in float32 between Casts: onnxruntime's float16 kernel gives the same numbers, but between a norm
and an Attention computed in float32 (rmsnorm-float32, attention-float32) the islands family then drops the Casts to
float16 and back on both sides, as onnxruntime ran the float16 chain it replaces in float32 throughout
(qwen3_dynamo_fp16 at opset 23: 1.020 of the variant's error to the float32 export, over 12 draws, without; 0.988
with). Where the rotated x is a head split merged straight back
after the op (the query the attention rules take in 3-D), ``ort-rotary-embedding-3d`` runs the op on the 3-D
projection with num_heads, without the split and merge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Dim, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._float32 import in_float32
from graphopt.passes.fuse.rules._helpers import shared_reader
from graphopt.passes.fuse.rules._ort import MS, cpu_float
from graphopt.passes.rewrite.engine import Build, Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import OpPattern, Pattern, const, op, optional, var
from graphopt.passes.rewrite.proofs import HEADS, merge_refusal, split_count

FAMILY = "rotary"

_x = var("x")


def _slice_of(source: Pattern, name: str) -> OpPattern:
    bounds = (var(f"{name}_start"), var(f"{name}_end"), optional(var(f"{name}_axes")), optional(var(f"{name}_steps")))
    return op.Slice(source, *bounds, name=name)


# Rotate half: Concat(-x[..., d/2:], x[..., :d/2]).
_HALVES = op.Concat(op.Neg(_slice_of(_x, "x2"), name="neg"), _slice_of(_x, "x1"), name="rotate")
# Interleaved (GPT-J's rotate_every_two): stack(-x[..., 1::2], x[..., ::2], -1) flattened back to x's shape.
_PAIRS = op.Reshape(
    op.Concat(
        op.Unsqueeze(op.Neg(_slice_of(_x, "x2"), name="neg"), const(name="odd_axis"), name="odd"),
        op.Unsqueeze(_slice_of(_x, "x1"), const(name="even_axis"), name="even"),
        name="rotate",
    ),
    var("pairs_shape"),
    name="merge",
)


def _rope(rotated: Pattern) -> OpPattern:
    return op.Add(op.Mul(_x, var("cos"), name="x_cos"), op.Mul(rotated, var("sin"), name="rot_sin"), name="rope")


def _partial(rope: OpPattern) -> OpPattern:
    """The rotation of ``x = whole[..., :r]`` followed by the rest ``whole[..., r:]``."""
    return op.Concat(rope, _slice_of(var("whole"), "rest"), name="partial")


# x's types: the standard RotaryEmbedding's (opset 23); onnxruntime's CPU contrib kernel takes no bfloat16
# (cpu_float in _plan_ort).
_TYPES = (DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16)
# Element-wise ops that keep equal halves equal (the scale's other input must be a scalar).
_HALF_KEEPING = frozenset({"Cos", "Sin", "Cast", "Identity", "Mul", "Div"})
_MAX_DEPTH = 8


@dataclass
class _Cache:
    """One of cos / sin as RotaryEmbedding wants it: a constant table (with the position ids
    that index it, or already (batch, seq, r/2)), or a run-time value: its first half
    (``halve``) or the value itself is the cache, its axis ``heads_axis`` (of size 1) dropped
    where it has one."""

    table: np.ndarray | None = None
    positions: Value | None = None
    runtime: Value | None = None
    halve: bool = True
    heads_axis: int = 1
    batch_of: Value | None = None  # a graph input whose axis 0 is x's batch, when runtime's batch is 1


def _halves_equal(value: Value, axis: int) -> bool:
    """Whether ``value``'s two halves along ``axis`` (negative) are provably equal."""
    for _ in range(_MAX_DEPTH):
        array = Site.array(value, limit=1 << 24)
        if array is not None:
            if array.ndim < -axis or array.shape[axis] % 2:
                return False
            first, second = np.split(array, 2, axis=axis)
            return bool(np.array_equal(first, second))
        node = value.producer
        if node is None:
            return False
        if node.op_type == "Concat":
            rank = Site.rank(value)
            on_axis = rank is not None and node.attr("axis") in (axis, rank + axis)
            return on_axis and len(node.inputs) == 2 and node.input(0) is node.input(1)
        if node.op_type == "Gather" and node.in_standard_domain:
            rank = Site.rank(node.input(0))
            if rank is None or Site.int_attr(node, "axis", 0) % rank == rank - 1:
                return False  # gathering along the halves' axis
            source = node.input(0)
        elif node.op_type == "Unsqueeze":
            rank = Site.rank(value)
            added = Site.array(node.input(1)) if len(node.inputs) > 1 and node.input(1) is not None else None
            if rank is None or added is None or any(int(a) % rank == rank + axis for a in added.ravel()):
                return False
            source = node.input(0)
        elif node.op_type in _HALF_KEEPING and node.in_standard_domain:
            source = node.input(0)
            if node.op_type in ("Mul", "Div"):
                scalars = [v for v in node.inputs if (a := Site.array(v)) is not None and a.size == 1]
                if len(scalars) != 1:
                    return False
                source = next(v for v in node.inputs if v is not scalars[0])
        else:
            return False
        if source is None:
            return False
        value = source
    return False


def _cache_part(table: np.ndarray, interleaved: bool) -> np.ndarray | None:
    """The cache a constant cos / sin ``table`` (last axis r) stands for: its first half, or
    its even entries when each pair is equal (interleaved); None when the pairs differ."""
    if not interleaved:
        return np.ascontiguousarray(table[..., : table.shape[-1] // 2])
    even, odd = table[..., ::2], table[..., 1::2]
    return np.ascontiguousarray(even) if np.array_equal(even, odd) else None


def _unsqueezed_at(value: Value, axis: int) -> Value | None:
    """The input of ``Unsqueeze(v, [axis])`` producing ``value``, or None."""
    node = value.producer
    if node is None or node.op_type != "Unsqueeze" or len(node.inputs) < 2 or node.input(1) is None:
        return None
    axes = Site.array(node.input(1))
    return node.input(0) if axes is not None and axes.ravel().tolist() == [axis] else None


def _repeated_pairs(value: Value) -> tuple[Value, set[int]] | None:
    """``c`` when ``value`` is ``c`` with each entry of its last axis repeated twice
    (repeat_interleave: Reshape(Tile or Expand(Unsqueeze(c, axes), [1, ..., 1, 2])) with a new
    last axis among ``axes``), and the axes its Unsqueeze added (of the rank-5 result); else None."""
    merge = value.producer
    tiled = merge.input(0) if merge is not None and merge.op_type == "Reshape" else None
    tile = tiled.producer if tiled is not None else None
    if tiled is None or tile is None or tile.op_type not in ("Tile", "Expand") or not tile.in_standard_domain:
        return None
    source = tile.input(0)
    unsqueeze = source.producer if source is not None else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) < 2:
        return None
    repeats, axes, c = Site.array(tile.input(1)), Site.array(unsqueeze.input(1)), unsqueeze.input(0)
    shape, merged = Site.shape(tiled), Site.shape(value)
    if repeats is None or axes is None or shape is None or merged is None or c is None:
        return None
    rank = len(shape)
    added = {int(a) % rank for a in axes.ravel()}
    if rank - 1 not in added or repeats.ravel().tolist() != [1] * (rank - 1) + [2]:
        return None  # not a new last axis repeated twice
    if merged[:-1] != shape[:-2] or not isinstance(shape[-2], int) or merged[-1] != 2 * shape[-2]:
        return None  # the Reshape does not merge the (r/2, 2) pairs into r
    return c, added


@dataclass(frozen=True)
class _Dims:
    """x's dims read in one of its layouts: (batch, heads, seq, r), the op's 4-D form, or
    (batch, seq, heads, r), GPT-J's before its head transpose, which the op takes as 3-D
    (batch, seq, heads * r) with num_heads."""

    shape: tuple[Dim, ...]
    heads_axis: int

    @property
    def batch(self) -> Dim:
        return self.shape[0]

    @property
    def seq(self) -> Dim:
        return self.shape[3 - self.heads_axis]

    @property
    def heads(self) -> Dim:
        return self.shape[self.heads_axis]

    @property
    def size(self) -> int:
        size = self.shape[3]
        assert isinstance(size, int)
        return size

    def with_one_head(self, lead: Dim, width: int) -> tuple[Dim, ...]:
        """The shape of a cos / sin that broadcasts over the heads."""
        return (lead, 1, self.seq, width) if self.heads_axis == 1 else (lead, self.seq, 1, width)


def _batch_source(site: Site, batch: Dim) -> Value | None:
    """A graph input whose axis 0 is ``batch``: onnxruntime wants a cache's batch spelled out,
    taken from an input so that every layer shares the expansion."""
    return next((v for v in site.graph.inputs if (site.shape(v) or (None,))[0] == batch), None)


def _lead(site: Site, value: Value, dims: _Dims, width: int) -> tuple[Dim, Value | None] | None:
    """The batch of ``value`` when it is (batch or 1, ..., width) with an axis of 1 where x has
    its heads, and the graph input to take x's batch from when it is 1; None when it is not."""
    shape = site.shape(value)
    if shape == dims.with_one_head(dims.batch, width):
        return dims.batch, None
    if dims.batch != 1 and shape == dims.with_one_head(1, width):
        source = _batch_source(site, dims.batch)
        return None if source is None else (1, source)
    return None


def _gathered(value: Value, dims: _Dims, interleaved: bool) -> _Cache | None:
    """``table[positions]`` unsqueezed over the heads, with a constant (max position, r)
    table and int64 positions of x's (batch, seq): the table's cache part and the positions."""
    rows = _unsqueezed_at(value, dims.heads_axis)
    gather = rows.producer if rows is not None else None
    if gather is None or gather.op_type != "Gather" or gather.attr("axis", 0) != 0 or not gather.in_standard_domain:
        return None
    table, positions = Site.array(gather.input(0), limit=1 << 24), gather.input(1)
    if table is None or table.ndim != 2 or table.shape[1] != dims.size or positions is None:
        return None
    if Site.shape(positions) != (dims.batch, dims.seq) or Site.dtype(positions) != DataType.INT64:
        return None
    part = _cache_part(table, interleaved)
    return None if part is None else _Cache(table=part, positions=positions)


def _cache(m: Match, site: Site, name: str, dims: _Dims, interleaved: bool) -> _Cache | Refuse:
    """``cos`` or ``sin`` as a cache for x of ``dims``, or why not."""
    value = m.value(name)
    if not interleaved and not _halves_equal(value, -1):
        return Refuse(f"the halves of {name} are not provably equal")
    gathered = _gathered(value, dims, interleaved)
    if gathered is not None:
        return gathered
    array = Site.array(value, limit=1 << 24)
    static = [d for d in dims.with_one_head(dims.batch, dims.size) if isinstance(d, int)]
    if array is not None and len(static) == 4:
        try:
            table = np.broadcast_to(array, static)
        except ValueError:
            return Refuse(f"{name} does not broadcast over x's heads only")
        part = _cache_part(np.take(table, 0, axis=dims.heads_axis), interleaved)
        return Refuse(f"the pairs of {name} are not equal") if part is None else _Cache(table=part)
    lead = _lead(site, value, dims, dims.size)
    if lead is None:
        return Refuse(f"{name} is not provably (batch or 1, seq, r) with an axis of 1 over x's heads")
    batch, batch_of = lead
    # The cache's source: cos itself, whose first half is the cache, or the c that cos repeats in pairs.
    source, width = value, dims.size
    if interleaved:
        repeated = _repeated_pairs(value)
        width = dims.size // 2
        if repeated is None:
            return Refuse(f"{name} is not provably c repeated in pairs")
        source, added = repeated
        rows = added == {dims.heads_axis, 4} and site.shape(source) == (batch, dims.seq, width)
        if not rows and not (added == {4} and site.shape(source) == dims.with_one_head(batch, width)):
            return Refuse(f"the c that {name} repeats in pairs is not (batch or 1, seq, r/2) over x's heads")
    # Without the heads axis where an Unsqueeze added it (else the cache's Squeeze drops it).
    unsqueezed = _unsqueezed_at(source, dims.heads_axis) if site.rank(source) == 4 else None
    if unsqueezed is not None and site.shape(unsqueezed) == (batch, dims.seq, width):
        source = unsqueezed
    return _Cache(runtime=source, halve=not interleaved, heads_axis=dims.heads_axis, batch_of=batch_of)


def _bounds(site: Site, node: Node) -> tuple[int, int, int] | None:
    """(start, end, step) of a Slice over the last axis of its 4-D input, when static."""
    facts = site.ctx.facts(site.model)
    given = (*node.inputs[1:], None, None)[:4]
    start, end, axes, steps = (facts.sym(v) if v is not None else None for v in given)
    if (given[2] is not None and axes is None) or (given[3] is not None and steps is None):
        return None  # axes or steps given but not known
    axes, steps = axes or (3,), steps or (1,)
    if start is None or end is None or len(start) != 1 or len(end) != 1 or len(axes) != 1 or len(steps) != 1:
        return None
    if not isinstance(axes[0], int) or axes[0] % 4 != 3:
        return None
    first, last, step = start[0], end[0], steps[0]
    if isinstance(first, int) and isinstance(last, int) and isinstance(step, int):
        return first, last, step
    return None


def _rotated(m: Match, site: Site, size: int, interleaved: bool) -> Refuse | None:
    """Why the rotated term is not x's rotate-half or rotate-pairs of ``size``, or None."""
    first, second = _bounds(site, m.node("x1")), _bounds(site, m.node("x2"))
    if first is None or second is None:
        return Refuse("the Slices are not static slices of the last axis")
    rotate_axis = m.node("rotate").attr("axis")
    if not interleaved:
        half = size // 2
        if first != (0, half, 1) or second[0] != half or second[1] < size or second[2] != 1:
            return Refuse("the Slices are not the two halves of the last axis")
        return None if rotate_axis in (-1, 3) else Refuse("the Concat is not over the last axis")
    if first[0] != 0 or second[0] != 1 or first[2] != 2 or second[2] != 2 or min(first[1], second[1]) < size:
        return Refuse("the Slices are not the even and odd entries of the last axis")
    added = [Site.array(m.value(n)) for n in ("odd_axis", "even_axis")]
    if any(a is None or a.ravel().tolist() not in ([-1], [4]) for a in added) or rotate_axis not in (-1, 4):
        return Refuse("the pairs are not stacked on a new last axis")
    if site.shape(m.node("merge").outputs[0]) != site.shape(m.value("x")):
        return Refuse("the stacked pairs are not provably flattened back to x's shape")
    return None


def _whole(m: Match, site: Site, size: int) -> int | Refuse:
    """The full last size of x's source when only its first ``size`` rotate, or why not."""
    whole, head = m.value("whole"), m.value("x").producer
    dims = site.shape(whole)
    if head is None or head.op_type != "Slice" or head.input(0) is not whole:
        return Refuse("x is not a slice of the value the Concat completes")
    if dims is None or len(dims) != 4 or not isinstance(dims[3], int):
        return Refuse("the full last axis is not static")
    rest = _bounds(site, m.node("rest"))
    if _bounds(site, head) != (0, size, 1) or rest is None or rest[0] != size or rest[1] < dims[3] or rest[2] != 1:
        return Refuse(f"the rotated part is not whole[..., :{size}] and the rest whole[..., {size}:]")
    return dims[3] if m.node("partial").attr("axis") in (-1, 3) else Refuse("the Concat is not over the last axis")


@dataclass
class _Plan:
    cos: _Cache
    sin: _Cache
    dims: _Dims
    interleaved: bool
    whole: int | None  # x's source's last size when only the first dims.size of it rotate


def _plan(interleaved: bool, m: Match, site: Site) -> _Plan | Refuse:
    x = m.value("x")
    shape = site.shape(x)
    if site.dtype(x) not in _TYPES or shape is None or len(shape) != 4:
        return Refuse("x is not a 4-D float32, float16 or bfloat16 tensor")
    size = shape[3]
    if not isinstance(size, int) or size % 2 or None in shape:
        return Refuse("the rotated size is not static and even")
    reason = _rotated(m, site, size, interleaved)
    if reason is not None:
        return reason
    whole = _whole(m, site, size) if "whole" in m else None
    if isinstance(whole, Refuse):
        return whole
    refusals: list[Refuse] = []
    for heads_axis in (1, 2):
        dims = _Dims(tuple(shape), heads_axis)
        if heads_axis == 2 and not isinstance(dims.heads, int):
            break  # the 3-D form's num_heads
        cos, sin = _cache(m, site, "cos", dims, interleaved), _cache(m, site, "sin", dims, interleaved)
        if isinstance(cos, Refuse):
            refusals.append(cos)
        elif isinstance(sin, Refuse):
            refusals.append(sin)
        elif (
            (cos.table is None) != (sin.table is None)
            or cos.positions is not sin.positions
            or ((cos.batch_of is None) != (sin.batch_of is None))
        ):
            refusals.append(Refuse("cos and sin are not indexed alike"))
        else:
            return _Plan(cos, sin, dims, interleaved, whole)
    return refusals[0]


_HALF_CACHE = "rotary_half_cache"


def _cache_value(b: Builder, cache: _Cache, size: int, name: str) -> Value:
    """The cache as a value: a constant, or made from the run-time value (once per model)."""
    if cache.table is not None:
        return b.constant(cache.table, f"{name}_cache")
    source = cache.runtime
    assert source is not None
    if cache.halve:
        runtime = source
        bounds = [b.constant(np.array([v], np.int64), "bound") for v in (0, size // 2, -1)]
        source = shared_reader(runtime, _HALF_CACHE, lambda: b.op("Slice", runtime, *bounds, name=_HALF_CACHE))
    if Site.rank(cache.runtime) == 4:
        source = _squeezed(b, source, cache.heads_axis)
    return source if cache.batch_of is None else _batched(b, source, cache.batch_of)


_BATCHED = "rotary_batched_cache"


def _batched(b: Builder, half: Value, batch_of: Value) -> Value:
    """``half`` (1, seq, r/2) expanded to the batch of ``batch_of`` (made once per cache)."""

    def expand() -> Value:
        batch = b.shape(batch_of, 0, 1)
        ones = b.constant(np.ones(2, np.int64), "ones")
        return b.op("Expand", half, b.op("Concat", batch, ones, axis=0), name=_BATCHED)

    return shared_reader(half, _BATCHED, expand)


_SQUEEZED = "rotary_squeezed_cache"


def _squeezed(b: Builder, half: Value, heads_axis: int) -> Value:
    """``half`` without its heads axis (made once, like the Slice)."""
    axes = b.constant(np.array([heads_axis], np.int64), "axes")
    return shared_reader(half, _SQUEEZED, lambda: b.op("Squeeze", half, axes, name=_SQUEEZED))


Make = Callable[[Value, dict[str, int]], Value]


def _rotary(b: Builder, m: Match, plan: _Plan, make: Make, ort: bool) -> Value:
    """``make(x, attributes)`` on x, or on the whole value x is the first part of (partial
    rotation), in the layout the op takes: 4-D heads first, or 3-D with num_heads."""
    x = m.value("x") if plan.whole is None else m.value("whole")
    attributes = {"interleaved": 1} if plan.interleaved else {}
    if plan.whole is not None:
        attributes["rotary_embedding_dim"] = plan.dims.size
    heads = plan.dims.heads
    if plan.dims.heads_axis == 1:
        if ort and plan.whole is not None and isinstance(heads, int):
            attributes["num_heads"] = heads  # onnxruntime's kernel wants it with rotary_embedding_dim
        return make(x, attributes)
    assert isinstance(heads, int)
    attributes["num_heads"] = heads
    flat = b.op("Reshape", x, b.constant(np.array([0, 0, -1], np.int64), "shape"))
    back = b.constant(np.array([0, 0, heads, plan.whole or plan.dims.size], np.int64), "shape")
    return b.op("Reshape", make(flat, attributes), back)


def _build(b: Builder, m: Match, plan: _Plan) -> Value:
    cos = _cache_value(b, plan.cos, plan.dims.size, "cos")
    sin = _cache_value(b, plan.sin, plan.dims.size, "sin")
    ids = [] if plan.cos.positions is None else [plan.cos.positions]
    return _rotary(b, m, plan, lambda x, attributes: b.op("RotaryEmbedding", x, cos, sin, *ids, **attributes), False)


_FLAT = "ort_rotary_flat"
_IDS = "ort_rotary_ids"
_DIMS = "ort_rotary_dims"


def _plan_ort(interleaved: bool, m: Match, site: Site) -> _Plan | Refuse:
    plan = _plan(interleaved, m, site)
    if not isinstance(plan, _Plan):
        return plan
    untaken = cpu_float(site, m.value("x"), "RotaryEmbedding")
    if untaken is not None:
        return Refuse(untaken)
    if plan.whole is not None and not isinstance(plan.dims.heads, int):
        return Refuse("onnxruntime's kernel wants num_heads with rotary_embedding_dim, and the heads are not static")
    return plan


def _flat(b: Builder, cache: Value, half: int) -> Value:
    shape = b.constant(np.array([-1, half], np.int64), "shape")
    return shared_reader(cache, _FLAT, lambda: b.op("Reshape", cache, shape, name=_FLAT))


def _row_ids(b: Builder, cache: Value) -> Value:
    """(batch, seq) int64 ids counting the rows of the (batch, seq, d/2) ``cache`` flattened."""
    dims = shared_reader(cache, _DIMS, lambda: b.shape(cache, 0, 2, name=_DIMS))

    def make_ids() -> Value:
        rows = b.op("ReduceProd", dims, keepdims=0)
        zero, one = b.constant(np.array(0, np.int64), "zero"), b.constant(np.array(1, np.int64), "one")
        return b.op("Reshape", b.op("Range", zero, rows, one), dims, name=_IDS)

    return shared_reader(dims, _IDS, make_ids)


def _caches(b: Builder, m: Match, plan: _Plan) -> tuple[Value, Value, Value]:
    """(position ids, cos cache, sin cache) as the kernel wants them."""
    half = plan.dims.size // 2
    cos, sin = plan.cos, plan.sin
    if cos.table is not None and sin.table is not None:
        if cos.positions is not None:
            return cos.positions, b.constant(cos.table, "cos_cache"), b.constant(sin.table, "sin_cache")
        batch, seq = cos.table.shape[:2]
        ids = b.constant(np.arange(batch * seq, dtype=np.int64).reshape(batch, seq), "position_ids")
        tables = [np.ascontiguousarray(t.reshape(-1, half)) for t in (cos.table, sin.table)]
        return ids, b.constant(tables[0], "cos_cache"), b.constant(tables[1], "sin_cache")
    shared = cos.batch_of is not None
    caches = [_cache_value(b, replace(c, batch_of=None), plan.dims.size, n) for c, n in ((cos, "cos"), (sin, "sin"))]
    flat = [_flat(b, c, half) for c in caches]
    ids = b.constant(np.array([0], np.int64), "offset") if shared else _row_ids(b, caches[0])
    return ids, flat[0], flat[1]


def _build_ort(b: Builder, m: Match, plan: _Plan) -> Value:
    ids, cos, sin = _caches(b, m, plan)
    return _rotary(
        b, m, plan, lambda x, attributes: b.op("RotaryEmbedding", x, ids, cos, sin, domain=MS, **attributes), True
    )


# -- target ort: the rotary on the 3-D projection between a head split and a head merge -----------------------------
#
# onnxruntime's RotaryEmbedding takes x as (batch, seq, heads * head size) with num_heads as well as 4-D. Where the x
# it rotates is a head split Transpose(Reshape(x3, (B, S, H, d)), [0, 2, 1, 3]) merged straight back after it,
# Reshape(Transpose(rotated, [0, 2, 1, 3]), (B, S, H * d)) (the query, or GroupQueryAttention's new keys, that the
# attention rules take in 3-D), the op runs on x3 with num_heads = H and the split and merge go (8 such rotaries
# of 8 heads of 32, 1 thread, ORT_ENABLE_ALL: 0.82x at batch 1 seq 8, 0.88x at batch 2 seq 1, 0.80x at seq 128).

_SPLIT_ROTARY_MERGE = op.Reshape(
    op.Transpose(
        op.RotaryEmbedding(
            op.Transpose(op.Reshape(var("x"), var("split_shape"), name="split"), perm=HEADS, name="split_t"),
            var("ids"),
            var("cos"),
            var("sin"),
            domain=MS,
            name="rotary",
        ),
        perm=HEADS,
        name="merge_t",
    ),
    var("merge_shape"),
    name="merge",
)


def _plan_3d(m: Match, site: Site) -> dict[str, Any] | Refuse:
    rotary = m.node("rotary")
    counts = split_count(m.node("split").outputs[0], site)
    x = site.shape(m.value("x"))
    if counts is None or x is None or len(x) != 3:
        return Refuse("the head split of x (batch, seq, heads * head size) is not provable")
    heads, size = counts
    if rotary.attr("num_heads", 0) not in (0, heads):
        return Refuse("the RotaryEmbedding's num_heads is not the head split's")
    reason = merge_refusal(m.node("merge"), site, heads * size, x[0], x[1])
    if reason is not None:
        return Refuse(reason)
    return {**{name: rotary.attr(name) for name in rotary.attributes}, "num_heads": heads}


def _build_3d(b: Builder, m: Match, attributes: dict[str, Any]) -> Value:
    inputs = (m.value(name) for name in ("x", "ids", "cos", "sin"))
    return b.op("RotaryEmbedding", *inputs, domain=MS, **attributes)


# The spellings, each (rule name suffix, pattern, interleaved, what it rewrites).
_FORMS = (
    ("", _rope(_HALVES), False, "x * cos + Concat(-x2, x1) * sin (rotate half)"),
    ("-partial", _partial(_rope(_HALVES)), False, "Concat(rotate half of x[..., :r], x[..., r:])"),
    ("-interleaved", _rope(_PAIRS), True, "x * cos + Stack(-x[..., 1::2], x[..., ::2]) * sin (pairs)"),
    ("-interleaved-partial", _partial(_rope(_PAIRS)), True, "Concat(pairs rotation of x[..., :r], x[..., r:])"),
)
# The targets, each (rule name prefix, plan, build, the op written, the gate).
_TARGETS: tuple[tuple[str, Callable[..., _Plan | Refuse], Build[_Plan], str, dict[str, Any]], ...] = (
    ("ort-", _plan_ort, _build_ort, "com.microsoft RotaryEmbedding (target ort)", {"targets": frozenset({"ort"})}),
    ("", _plan, _build, "RotaryEmbedding (opset 23)", {"min_opset": 23}),
)

RULES: tuple[Rule[Any], ...] = (
    *(
        Rule(
            name=f"{prefix}rotary-embedding{suffix}",
            family=FAMILY,
            pattern=pattern,
            plan=partial(plan, interleaved),
            build=build,
            label="RotaryEmbedding",
            doc=f"{spelling} -> {written}",
            **gate,
        )
        for prefix, plan, build, written, gate in _TARGETS
        for suffix, pattern, interleaved, spelling in _FORMS
    ),
    Rule(
        name="ort-rotary-embedding-3d",
        family=FAMILY,
        pattern=_SPLIT_ROTARY_MERGE,
        plan=_plan_3d,
        build=_build_3d,
        targets=frozenset({"ort"}),
        label="RotaryEmbedding",
        doc="head merge of com.microsoft RotaryEmbedding on a head split -> the op on the 3-D projection with "
        "num_heads (target ort)",
    ),
    in_float32(
        "rotary-embedding-float32",
        FAMILY,
        "RotaryEmbedding",
        4,
        min_opset=23,
        label="float16 RotaryEmbedding",
        doc="RotaryEmbedding on float16 -> Cast to float32, RotaryEmbedding, Cast to float16: the same numbers as "
        "onnxruntime's float16 kernel, which rounds its result once too, but in float32 it joins the float32 norm "
        "before it and the Attention after it (islands family), as the Mul and Add it replaces did",
    ),
)
