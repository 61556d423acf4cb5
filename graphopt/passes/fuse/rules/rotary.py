"""Rotary family: rotate-half rotary embeddings -> RotaryEmbedding (opset 23).

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
float32 and float16, with the caches in x's type.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import is_float, shared_reader
from graphopt.passes.fuse.rules._ort import MS
from graphopt.passes.rewrite.engine import Match, Rule, Site
from graphopt.passes.rewrite.patterns import OpPattern, op, optional, var

FAMILY = "rotary"

_x = var("x")


def _half(name: str) -> OpPattern:
    bounds = (var(f"{name}_start"), var(f"{name}_end"), optional(var(f"{name}_axes")), optional(var(f"{name}_steps")))
    return op.Slice(_x, *bounds, name=name)


_ROTATED = op.Concat(op.Neg(_half("x2"), name="neg"), _half("x1"), name="rotate")
_ROPE = op.Add(op.Mul(_x, var("cos"), name="x_cos"), op.Mul(_ROTATED, var("sin"), name="rot_sin"), name="rope")

# Element-wise ops that keep equal halves equal (the scale's other input must be a scalar).
_HALF_KEEPING = frozenset({"Cos", "Sin", "Cast", "Identity", "Mul", "Div"})
_MAX_DEPTH = 8


@dataclass
class _Cache:
    """One of cos / sin as RotaryEmbedding wants it: a constant half table (with the
    position ids that index it, or already (batch, seq, d/2)), or a run-time value to slice."""

    table: np.ndarray | None = None
    positions: Value | None = None
    runtime: Value | None = None  # (batch, seq, d) or (batch, 1, seq, d): its first half is the cache
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


def _unsqueezed_over_heads(value: Value) -> Value | None:
    """The input of ``Unsqueeze(v, [1])`` producing ``value``, or None."""
    node = value.producer
    if node is None or node.op_type != "Unsqueeze" or len(node.inputs) < 2 or node.input(1) is None:
        return None
    axes = Site.array(node.input(1))
    return node.input(0) if axes is not None and axes.ravel().tolist() == [1] else None


def _gathered(value: Value, dims: tuple[object, ...]) -> _Cache | None:
    """``table[positions][:, None]`` with a constant (max position, d) table and int64
    positions of x's (batch, seq): the half table and the positions."""
    rows = _unsqueezed_over_heads(value)
    gather = rows.producer if rows is not None else None
    if gather is None or gather.op_type != "Gather" or gather.attr("axis", 0) != 0 or not gather.in_standard_domain:
        return None
    table, positions = Site.array(gather.input(0), limit=1 << 24), gather.input(1)
    batch, _, seq, size = dims
    if table is None or table.ndim != 2 or table.shape[1] != size or positions is None:
        return None
    if Site.shape(positions) != (batch, seq) or Site.dtype(positions) != DataType.INT64:
        return None
    return _Cache(table=np.ascontiguousarray(table[:, : table.shape[1] // 2]), positions=positions)


def _cache(m: Match, site: Site, name: str, dims: tuple[object, ...]) -> _Cache | str:
    """``cos`` or ``sin`` as a cache for x of shape ``dims`` (batch, heads, seq, d), or why not."""
    value = m.value(name)
    if not _halves_equal(value, -1):
        return f"the halves of {name} are not provably equal"
    gathered = _gathered(value, dims)
    if gathered is not None:
        return gathered
    batch, _, seq, size = dims
    array = Site.array(value, limit=1 << 24)
    if array is not None and isinstance(batch, int) and isinstance(seq, int) and isinstance(size, int):
        try:
            table = np.broadcast_to(array, (batch, 1, seq, size))
        except ValueError:
            return f"{name} does not broadcast over x's heads only"
        return _Cache(table=np.ascontiguousarray(table[:, 0, :, : size // 2]))
    if site.shape(value) == (batch, 1, seq, size):
        rows = _unsqueezed_over_heads(value)
        # Without the heads axis the cache needs no Squeeze.
        return _Cache(runtime=rows if rows is not None and site.shape(rows) == (batch, seq, size) else value)
    if site.shape(value) == (1, 1, seq, size):
        # Positions shared by the batch (computed from one arange): onnxruntime wants the batch spelled out,
        # taken from a graph input so that every layer can share the expansion.
        source = next((v for v in site.graph.inputs if (site.shape(v) or (None,))[0] == batch), None)
        if source is not None:
            rows = _unsqueezed_over_heads(value)
            return _Cache(
                runtime=rows if rows is not None and site.shape(rows) == (1, seq, size) else value, batch_of=source
            )
    return f"{name} is not provably (batch or 1, 1, seq, head size) with x's seq (and batch, or a graph input's)"


def _slice_bounds(m: Match, site: Site, name: str, rank: int) -> tuple[int, int] | None:
    """(start, end) of the Slice ``name`` when it is over the last axis with step 1."""
    facts = site.ctx.facts(site.model)
    found = {}
    for part in ("start", "end", "axes", "steps"):
        value = m.optional(f"{name}_{part}")
        found[part] = None if value is None else facts.sym(value)
    axes, steps = found["axes"] or (rank - 1,), found["steps"] or (1,)
    start, end = found["start"], found["end"]
    if start is None or end is None or len(start) != 1 or len(end) != 1 or len(axes) != 1 or steps != (1,):
        return None
    if not isinstance(axes[0], int) or axes[0] % rank != rank - 1:
        return None
    if not isinstance(start[0], int) or not isinstance(end[0], int):
        return None
    return start[0], end[0]


@dataclass
class _Plan:
    cos: _Cache
    sin: _Cache
    size: int


def _plan(m: Match, site: Site) -> _Plan | str:
    x = m.value("x")
    dims = site.shape(x)
    if not is_float(x) or dims is None or len(dims) != 4:
        return "x is not a 4-D float tensor (batch, heads, seq, head size) of known type"
    size = dims[3]
    if not isinstance(size, int) or size % 2 or None in dims:
        return "the head size is not static and even"
    half = size // 2
    first, second = _slice_bounds(m, site, "x1", 4), _slice_bounds(m, site, "x2", 4)
    if first is None or second is None or first != (0, half) or second[0] != half or second[1] < size:
        return "the Slices are not the two halves of the last axis"
    if m.node("rotate").attr("axis") not in (-1, 3):
        return "the Concat is not over the last axis"
    cos, sin = _cache(m, site, "cos", tuple(dims)), _cache(m, site, "sin", tuple(dims))
    if isinstance(cos, str):
        return cos
    if isinstance(sin, str):
        return sin
    if (cos.table is None) != (sin.table is None) or cos.positions is not sin.positions:
        return "cos and sin are not indexed alike"
    return _Plan(cos, sin, size)


_HALF_CACHE = "rotary_half_cache"


def _cache_value(b: Builder, cache: _Cache, size: int, name: str) -> Value:
    """The cache as a value: a constant, or the first half of the run-time value (made once)."""
    if cache.table is not None:
        return b.constant(cache.table, f"{name}_cache")
    source = cache.runtime
    assert source is not None
    found = next(
        (u.node for u in source.uses() if u.node.op_type == "Slice" and u.node.name.startswith(_HALF_CACHE)), None
    )
    if found is None:
        bounds = [b.constant(np.array([v], np.int64), "bound") for v in (0, size // 2, -1)]
        found = b.node("Slice", source, *bounds, name=_HALF_CACHE)
    half = _squeezed(b, found.outputs[0], source)
    return half if cache.batch_of is None else _batched(b, half, cache.batch_of)


_BATCHED = "rotary_batched_cache"


def _batched(b: Builder, half: Value, batch_of: Value) -> Value:
    """``half`` (1, seq, d/2) expanded to the batch of ``batch_of`` (made once per cache)."""
    for use in half.uses():
        if use.node.op_type == "Expand" and use.node.name.startswith(_BATCHED):
            return use.node.outputs[0]
    batch = b.op("Shape", batch_of, start=0, end=1)
    ones = b.constant(np.ones(2, np.int64), "ones")
    return b.op("Expand", half, b.op("Concat", batch, ones, axis=0), name=_BATCHED)


def _squeezed(b: Builder, half: Value, source: Value) -> Value:
    """``half`` without the heads axis, when ``source`` has one (shared like the Slice)."""
    if Site.rank(source) == 3:
        return half
    for use in half.uses():
        if use.node.op_type == "Squeeze":
            return use.node.outputs[0]
    return b.op("Squeeze", half, b.constant(np.array([1], np.int64), "axes"))


def _build(b: Builder, m: Match, plan: _Plan) -> Value:
    cos = _cache_value(b, plan.cos, plan.size, "cos")
    sin = _cache_value(b, plan.sin, plan.size, "sin")
    if plan.cos.positions is None:
        return b.op("RotaryEmbedding", m.value("x"), cos, sin)
    return b.op("RotaryEmbedding", m.value("x"), cos, sin, plan.cos.positions)


_KERNEL_TYPES = (DataType.FLOAT, DataType.FLOAT16)
_FLAT = "ort_rotary_flat"
_IDS = "ort_rotary_ids"
_DIMS = "ort_rotary_dims"


def _plan_ort(m: Match, site: Site) -> _Plan | str:
    dtype = site.dtype(m.value("x"))
    if dtype not in _KERNEL_TYPES:
        return "onnxruntime's CPU RotaryEmbedding runs float32 and float16 only"
    if any(site.dtype(m.value(name)) != dtype for name in ("cos", "sin")):
        return "cos / sin are not in x's type"
    return _plan(m, site)


def _flat(b: Builder, cache: Value, half: int) -> Value:
    shape = b.constant(np.array([-1, half], np.int64), "shape")
    return shared_reader(cache, _FLAT, lambda: b.op("Reshape", cache, shape, name=_FLAT))


def _row_ids(b: Builder, cache: Value) -> Value:
    """(batch, seq) int64 ids counting the rows of the (batch, seq, d/2) ``cache`` flattened."""
    dims = shared_reader(cache, _DIMS, lambda: b.op("Shape", cache, start=0, end=2, name=_DIMS))

    def make_ids() -> Value:
        rows = b.op("ReduceProd", dims, keepdims=0)
        zero, one = b.constant(np.array(0, np.int64), "zero"), b.constant(np.array(1, np.int64), "one")
        return b.op("Reshape", b.op("Range", zero, rows, one), dims, name=_IDS)

    return shared_reader(dims, _IDS, make_ids)


def _caches(b: Builder, m: Match, plan: _Plan) -> tuple[Value, Value, Value]:
    """(position ids, cos cache, sin cache) as the kernel wants them."""
    half = plan.size // 2
    cos, sin = plan.cos, plan.sin
    if cos.table is not None and sin.table is not None:
        if cos.positions is not None:
            return cos.positions, b.constant(cos.table, "cos_cache"), b.constant(sin.table, "sin_cache")
        batch, seq = cos.table.shape[:2]
        ids = b.constant(np.arange(batch * seq, dtype=np.int64).reshape(batch, seq), "position_ids")
        tables = [np.ascontiguousarray(t.reshape(-1, half)) for t in (cos.table, sin.table)]
        return ids, b.constant(tables[0], "cos_cache"), b.constant(tables[1], "sin_cache")
    shared = cos.batch_of is not None
    caches = [_cache_value(b, replace(c, batch_of=None), plan.size, n) for c, n in ((cos, "cos"), (sin, "sin"))]
    flat = [_flat(b, c, half) for c in caches]
    ids = b.constant(np.array([0], np.int64), "offset") if shared else _row_ids(b, caches[0])
    return ids, flat[0], flat[1]


def _build_ort(b: Builder, m: Match, plan: _Plan) -> Value:
    ids, cos, sin = _caches(b, m, plan)
    return b.op("RotaryEmbedding", m.value("x"), ids, cos, sin, domain=MS)


# Both targets rewrite the same proven pattern.
_rule = partial(Rule, family=FAMILY, pattern=_ROPE, label="RotaryEmbedding")

RULES: tuple[Rule, ...] = (
    _rule(
        name="ort-rotary-embedding",
        plan=_plan_ort,
        build=_build_ort,
        targets=frozenset({"ort"}),
        doc="x * cos + Concat(-x2, x1) * sin (rotate half) -> com.microsoft RotaryEmbedding (target ort)",
    ),
    _rule(
        name="rotary-embedding",
        plan=_plan,
        build=_build,
        min_opset=23,
        doc="x * cos + Concat(-x2, x1) * sin (rotate half) -> RotaryEmbedding (opset 23)",
    ),
)
