"""Shape family: chains of layout ops collapse to one.

- ``Transpose(Transpose(x, p), q) -> Transpose(x, p[q])``, or ``x`` when that is the identity;
  a Transpose whose perm is the identity is ``x``.
- ``Reshape(R(x), s) -> Reshape(x, s)`` for R any of Reshape / Flatten / Squeeze / Unsqueeze,
  when ``s`` is a constant; -1 is computed from the element count, which R does not change.
  A 0 in ``s`` copies a dim of R's output, which x may not have: it is spelled out, as the
  dim where the result's type knows it, else as -1 where ``s`` has no -1 already.
- ``Reshape(Transpose(x), s) -> Reshape(x, s)`` when the Transpose moves only dims of size 1
  (the others keep their order, so the data's order in memory does not change), for the same
  ``s`` as above; a dim not provably 1 counts as moved data.
- ``R2(R1(x))`` for R1, R2 among Flatten / Squeeze / Unsqueeze / Reshape, when R2's output
  shape is static: one Reshape to it.
- ``Unsqueeze(Unsqueeze(x, a), b)`` -> one Unsqueeze (also with symbolic dims); an inner Unsqueeze
  that only Unsqueezes read goes into each (a causal mask's row and column indices from one
  Range: two Unsqueezes, not three).
- ``Reshape(f(R(x)), s) -> Reshape(f(x), s)`` for f one or more element-wise ops of one such
  R's output and scalar constants, none read outside them, R as above and ``s`` as above (a
  late rule: it takes the Reshapes that ``matmul-add-gemm-projection`` writes around a GELU or
  a scale, which nothing else reads; the erf GELU of an opset below 20 is five ops, Div / Erf /
  Add / Mul / Mul). The ops it stands for are left for dce.
- ``Reshape(x, s)`` with ``s`` computed (``Concat(Shape(x)[0:1], [200])``) whose entries are
  provably static positive ints but one: ``Reshape(x, constant with -1 there)``. The element
  count fixes the one unknown entry, so the shape plumbing goes.
- ``Cast(Cast(x, T1), T2) -> Cast(x, T2)`` when ``T0 -> T1`` is lossless (every value of T0
  is exact in T1), and ``x`` itself when T2 is T0; a Cast to x's own type is ``x``.
- ``Slice(Slice(x, s1, e1, a1, t1), s2, e2, a2, t2)`` with constant bounds on axes the two do not
  share -> one Slice over both sets of axes (slicing one axis clamps against that axis only, so
  the two commute); LeViT's subsampling ``x[:, ::2, ::2]``. An inner Slice that only such Slices
  read goes into each (Swin's patch merging, ``x[:, 0::2, 0::2]``, ``x[:, 1::2, 0::2]`` and so on:
  four Slices, not six).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import CONTRIB_DOMAIN, DataType, Node, Value
from graphopt.ir.constness import is_constant
from graphopt.ir.ops import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY
from graphopt.ir.rewrite import Builder
from graphopt.passes.cleanup.rules import CAST_TO_SAME_TYPE, TRANSPOSE_IDENTITY
from graphopt.passes.fuse.rules._helpers import attrs_of, static_shape
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import ANY_DOMAIN, Pattern, const, op, optional, var
from graphopt.passes.rewrite.proofs import one_unknown, scalar_of_rank, spelled_target

FAMILY = "shape"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY)
_LAYOUT = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
_INNER = op.any_of(_LAYOUT, var("x"), optional(var("_")), name="inner")


def _perm(m: Match, name: str, rank: int | None) -> list[int] | None:
    perm = Site.ints_attr(m.node(name), "perm")
    if perm is None:
        return None if rank is None else list(range(rank - 1, -1, -1))
    return perm


def _composed(m: Match, site: Site) -> list[int] | None:
    rank = site.rank(m.value("x"))
    inner, outer = _perm(m, "inner", rank), _perm(m, "outer", rank)
    if inner is None or outer is None or len(inner) != len(outer):
        return None
    return [inner[q] for q in outer]


def _pair(op_type: str) -> Pattern:
    """``op_type(op_type(x))`` (entries "inner" and "outer")."""
    return op.any_of((op_type,), op.any_of((op_type,), var("x"), name="inner"), name="outer")


def _x_or(b: Builder, m: Match, identity: bool, op_type: str, **attrs: Any) -> Value:
    """``x`` itself when the collapsed pair is the identity, else one ``op_type`` of it."""
    return m.value("x") if identity else b.op(op_type, m.value("x"), **attrs)


def _plan_transposes(m: Match, site: Site) -> list[int] | Refuse:
    found = _composed(m, site)
    return Refuse("the rank is unknown") if found is None else found


def _build_transposes(b: Builder, m: Match, perm: list[int]) -> Value:
    return _x_or(b, m, perm == list(range(len(perm))), "Transpose", perm=perm)


def _plan_reshape_chain(m: Match, site: Site) -> np.ndarray | Refuse:
    return spelled_target(m.root, site)


def _plan_one_unknown(m: Match, site: Site) -> list[int] | Refuse:
    return one_unknown(m.root, site)


def _target(b: Builder, m: Match, target: np.ndarray) -> Value:
    """The target a rewritten Reshape reads: the outer one's own when it had no 0 to spell out."""
    shape = m.value("shape")
    own = Site.array(shape)
    return shape if own is not None and np.array_equal(target, own) else b.constant(target, "shape")


def _plan_reshape_transpose(m: Match, site: Site) -> np.ndarray | Refuse:
    target = spelled_target(m.root, site)
    if isinstance(target, Refuse):
        return target
    shape = site.shape(m.value("x"))
    perm = _perm(m, "inner", None if shape is None else len(shape))
    if shape is None or perm is None or len(perm) != len(shape):
        return Refuse("the input's rank is unknown")
    kept = [axis for axis in perm if shape[axis] != 1]
    return target if kept == sorted(kept) else Refuse("the Transpose moves data (dims not provably 1 change order)")


def _static_result(m: Match, site: Site) -> tuple[int, ...] | Refuse:
    found = static_shape(m.root.outputs[0])
    return Refuse("the result shape is not static") if found is None else found


def _merged_axes(m: Match, site: Site) -> list[int] | None:
    rank = site.rank(m.value("x"))
    first = _unsqueeze_axes(m, "inner", site)
    second = _unsqueeze_axes(m, "outer", site)
    if rank is None or first is None or second is None:
        return None
    middle = rank + len(first)
    first = sorted(a + middle if a < 0 else a for a in first)
    final = rank + len(first) + len(second)
    second = sorted(a + final if a < 0 else a for a in second)
    # The first Unsqueeze's new dims sit among the second's output at the positions not inserted there.
    kept = [i for i in range(final) if i not in second]
    return sorted([kept[a] for a in first] + second)


def _unsqueeze_axes(m: Match, name: str, site: Site) -> list[int] | None:
    node = m.node(name)
    if site.opset < 13:
        found = node.attr("axes")
        return None if found is None else [int(a) for a in found]
    array = Site.array(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if array is None else [int(a) for a in array.ravel()]


def _plan_unsqueezes(m: Match, site: Site) -> list[int] | Refuse:
    inner = m.node("inner").outputs[0]
    if inner.is_graph_output:
        return Refuse(f"{inner.name!r} is a graph output")
    for use in inner.uses():
        if use.node.op_type != "Unsqueeze" or use.index != 0:
            return Refuse(f"{inner.name!r} is also read by {use.node.name or use.node.op_type}, not an Unsqueeze")
    found = _merged_axes(m, site)
    return Refuse("the axes or the rank are unknown") if found is None else found


def _copy_for_other_readers(b: Builder, m: Match) -> None:
    """Where others of its kind read the match's exported ``inner`` node too, a copy stands for it
    until each has taken it in."""
    inner = m.node("inner")
    if len(inner.outputs[0].uses()) > 1:
        m.export("inner", b.op(inner.op_type, *inner.inputs, **attrs_of(inner)))


def _build_unsqueezes(b: Builder, m: Match, axes: list[int]) -> Value:
    inner = m.node("inner")
    # x as the inner node reads it now, not as bound: an Unsqueeze that made x may have been
    # replaced by its copy this round (three in a chain, the first read by two).
    x = inner.inputs[0]
    assert x is not None  # the pattern bound it
    _copy_for_other_readers(b, m)
    return b.listed("Unsqueeze", x, "axes", axes, as_input=m.site.opset >= 13).outputs[0]


_ELEMENTWISE = ELEMENTWISE_UNARY | ELEMENTWISE_BINARY
# onnxruntime's element-wise GELUs (--target ort writes them; with one input, no bias over the last axis).
_CONTRIB_ELEMENTWISE = frozenset({"Gelu", "FastGelu", "QuickGelu"})
# Most nodes an element-wise region may have (the erf GELU has five).
_REGION_LIMIT = 16


def _elementwise(node: Node | None) -> bool:
    """``node`` computes each output element from the same element of its inputs (its constants scalars)."""
    if node is None or len(node.outputs) != 1:
        return False
    if node.domain == CONTRIB_DOMAIN:
        return node.op_type in _CONTRIB_ELEMENTWISE and len([v for v in node.inputs if v is not None]) == 1
    return node.in_standard_domain and node.op_type in _ELEMENTWISE


def _walk_region(last: Node) -> tuple[list[Node], Value] | None:
    """The element-wise nodes ``last`` computes from and the one Reshape-like output they read, besides
    constants; None when some other value feeds them or they are more than the limit."""
    region: dict[Node, None] = {}
    reshaped: Value | None = None
    pending: list[Node | None] = [last]
    while pending:
        node = pending.pop()
        if node in region:
            continue
        if node is None or not _elementwise(node):
            return None
        region[node] = None
        if len(region) > _REGION_LIMIT:
            return None
        for value in node.inputs:
            producer = None if value is None or is_constant(value) else value.producer
            if producer is not None and producer.op_type in _LAYOUT and producer.in_standard_domain:
                if reshaped is not None and value is not reshaped:
                    return None
                reshaped = value
            elif value is not None and not is_constant(value):
                pending.append(producer)
    return (list(region), reshaped) if reshaped is not None else None


def _plan_region(m: Match, site: Site) -> tuple[np.ndarray, list[Node], Value] | Refuse:
    found = _walk_region(m.node("last"))
    target = spelled_target(m.root, site)
    if found is None or isinstance(target, Refuse):
        return target if isinstance(target, Refuse) else Refuse("the region changed")
    nodes, reshaped = found
    rank = site.rank(reshaped.producer.inputs[0]) if reshaped.producer is not None else None
    if rank is None:
        return Refuse("the reshaped input's rank is unknown")
    inside = set(nodes)
    for node in nodes:
        constants = [v for v in node.inputs if v is not None and is_constant(v)]
        if not all(scalar_of_rank(v, rank) for v in constants):
            return Refuse("a constant of the region is not a scalar of at most x's rank")
        out = node.outputs[0]
        if out.is_graph_output or any(u.node not in inside and u.node is not m.root for u in out.uses()):
            return Refuse("a value of the region has a reader outside it")
    if reshaped.is_graph_output or any(u.node not in inside for u in reshaped.uses()):
        return Refuse("the Reshape-like output has a reader outside the region")
    assert m.root.graph is not None
    return target, m.root.graph.ordered(nodes), reshaped


def _build_region(b: Builder, m: Match, plan: tuple[np.ndarray, list[Node], Value]) -> Value:
    target, nodes, reshaped = plan
    producer = reshaped.producer
    assert producer is not None and producer.inputs[0] is not None
    made: dict[Value, Value] = {reshaped: producer.inputs[0]}
    for node in nodes:
        inputs = [None if v is None else made.get(v, v) for v in node.inputs]
        made[node.outputs[0]] = b.op(node.op_type, *inputs, domain=node.domain, **attrs_of(node))
    return b.op("Reshape", made[m.node("last").outputs[0]], _target(b, m, target))


# Element types each type converts to exactly (every value survives the round trip).
_FLOATS = (DataType.FLOAT16, DataType.FLOAT, DataType.DOUBLE)
_LOSSLESS: dict[DataType, set[DataType]] = {
    DataType.FLOAT16: {DataType.FLOAT, DataType.DOUBLE},
    DataType.BFLOAT16: {DataType.FLOAT, DataType.DOUBLE},
    DataType.FLOAT: {DataType.DOUBLE},
    DataType.INT8: {DataType.INT16, DataType.INT32, DataType.INT64, *_FLOATS},
    DataType.UINT8: {DataType.INT16, DataType.UINT16, DataType.INT32, DataType.UINT32, DataType.INT64, *_FLOATS},
    DataType.INT16: {DataType.INT32, DataType.INT64, DataType.FLOAT, DataType.DOUBLE},
    DataType.UINT16: {DataType.INT32, DataType.UINT32, DataType.INT64, DataType.FLOAT, DataType.DOUBLE},
    DataType.INT32: {DataType.INT64, DataType.DOUBLE},
    DataType.UINT32: {DataType.INT64, DataType.UINT64, DataType.DOUBLE},
    DataType.BOOL: {
        DataType.INT8,
        DataType.UINT8,
        DataType.INT16,
        DataType.UINT16,
        DataType.INT32,
        DataType.UINT32,
        DataType.INT64,
        DataType.UINT64,
        *_FLOATS,
    },
}


def _check_casts(m: Match, site: Site) -> Refuse | None:
    source = site.dtype(m.value("x"))
    middle = m.node("inner").attr("to")
    if source is None:
        return Refuse("the input type is unknown")
    if middle is None or m.root.attr("to") is None:
        return Refuse("a Cast has no 'to'")
    if middle not in _LOSSLESS.get(source, set()) and middle != source:
        return Refuse(f"{source.name} -> {DataType(middle).name} may lose values")
    return None


def _build_casts(b: Builder, m: Match, plan: None) -> Value:
    to = Site.int_attr(m.root, "to", 0)
    return _x_or(b, m, m.site.dtype(m.value("x")) == to, "Cast", to=to)


def _slice(name: str, x: Pattern) -> Pattern:
    bounds = (const(name=f"starts_{name}"), const(name=f"ends_{name}"))
    return op.Slice(x, *bounds, optional(const(name=f"axes_{name}")), optional(const(name=f"steps_{name}")), name=name)


_SLICES = _slice("outer", _slice("inner", var("x")))


def _slice_parts(node: Node, rank: int | None) -> tuple[np.ndarray, ...] | None:
    """(starts, ends, axes made non-negative, steps) of the Slice ``node`` as int64, or None: a bound
    that is not a 1-D constant (the schema makes it int32 or int64), or a negative axis where the rank
    is unknown."""
    given = [*node.inputs[1:5], None, None][:4]
    arrays = [None if value is None else Site.array(value) for value in given]
    if any(value is not None and array is None for value, array in zip(given, arrays, strict=True)):
        return None
    starts, ends, axes, steps = arrays
    if starts is None or ends is None or starts.ndim != 1 or starts.shape != ends.shape:
        return None
    axes = np.arange(len(starts)) if axes is None else axes.astype(np.int64)
    if (axes < 0).any():
        if rank is None:
            return None
        axes = np.where(axes < 0, axes + rank, axes)
    steps = np.ones(len(starts), np.int64) if steps is None else steps
    return starts.astype(np.int64), ends.astype(np.int64), axes, steps.astype(np.int64)


def _plan_slices(m: Match, site: Site) -> tuple[np.ndarray, ...] | Refuse:
    rank = site.rank(m.value("x"))
    inner, outer = _slice_parts(m.node("inner"), rank), _slice_parts(m.root, rank)
    if inner is None or outer is None:
        return Refuse("the bounds are not 1-D int constants with axes that are known (a negative axis needs x's rank)")
    if set(inner[2].tolist()) & set(outer[2].tolist()):
        return Refuse("the Slices share an axis")
    shared = m.node("inner").outputs[0]
    if shared.is_graph_output:
        return Refuse(f"{shared.name!r} is a graph output")
    for use in shared.uses():
        # Every reader takes the inner Slice in (a copy stands for it until each has), so that it goes.
        reader = use.node
        taken = reader.op_type == "Slice" and reader.in_standard_domain and use.index == 0
        other = _slice_parts(reader, rank) if taken else None
        if other is None or set(inner[2].tolist()) & set(other[2].tolist()):
            return Refuse(f"{shared.name!r} is also read by {reader.name or reader.op_type}, which cannot take it in")
    return tuple(np.concatenate([a, b]) for a, b in zip(inner, outer, strict=True))


def _build_slices(b: Builder, m: Match, parts: tuple[np.ndarray, ...]) -> Value:
    inner = m.node("inner")
    # x as the inner node reads it now, not as bound: a Slice that made x may have been replaced
    # by its copy this round.
    x = inner.inputs[0]
    assert x is not None  # the pattern bound it
    _copy_for_other_readers(b, m)
    names = ("starts", "ends", "axes", "steps")
    return b.op("Slice", x, *(b.constant(part, name) for part, name in zip(parts, names, strict=True)))


def _reshape_x(b: Builder, m: Match, target: np.ndarray) -> Value:
    return b.op("Reshape", m.value("x"), _target(b, m, target))


def _reshape_x_static(b: Builder, m: Match, shape: tuple[int, ...]) -> Value:
    return b.op("Reshape", m.value("x"), b.constant(np.array(shape, np.int64), "shape"))


RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="transpose-transpose",
        pattern=_pair("Transpose"),
        plan=_plan_transposes,
        build=_build_transposes,
        label="Transpose pair",
        doc="Transpose(Transpose(x, p), q) -> Transpose(x, p[q]) or x",
    ),
    TRANSPOSE_IDENTITY,
    _rule(
        name="reshape-chain",
        pattern=op.Reshape(_INNER, var("shape"), name="outer"),
        plan=_plan_reshape_chain,
        build=_reshape_x,
        label="Reshape chain",
        doc="Reshape(Reshape|Flatten|Squeeze|Unsqueeze(x), s) -> Reshape(x, s)",
    ),
    _rule(
        name="reshape-through-elementwise",
        pattern=op.Reshape(
            # The walk as a test of structure: a Reshape of element-wise ops that read no Reshape-like
            # output is no near miss (measured: without it bert_ts's shape near misses doubled, 12 -> 24).
            op.any_of(
                sorted(_ELEMENTWISE | _CONTRIB_ELEMENTWISE),
                var("a"),
                optional(var("b")),
                optional(var("c")),
                name="last",
                domain=ANY_DOMAIN,
                where=lambda n: _walk_region(n) is not None,
            ),
            var("shape"),
            name="outer",
        ),
        plan=_plan_region,
        build=_build_region,
        kind="late",
        label="Reshape around element-wise ops",
        doc="Reshape(f(Reshape-like(x)), s) -> Reshape(f(x), s) for f one or more element-wise ops of x and scalars "
        "(late)",
    ),
    _rule(
        name="reshape-transpose",
        pattern=op.Reshape(op.Transpose(var("x"), name="inner"), var("shape"), name="outer"),
        plan=_plan_reshape_transpose,
        build=_reshape_x,
        label="Reshape of a Transpose",
        doc="Reshape(Transpose(x) moving only dims of 1, s) -> Reshape(x, s)",
    ),
    _rule(
        name="layout-chain-static",
        pattern=op.any_of(
            ("Flatten", "Squeeze", "Unsqueeze"),
            op.any_of(_LAYOUT, var("x"), optional(var("_")), name="inner"),
            optional(var("_2")),
            name="outer",
        ),
        plan=_static_result,
        build=_reshape_x_static,
        label="Reshape chain",
        doc="Flatten|Squeeze|Unsqueeze(Reshape-like(x)) with a static result -> Reshape(x, const)",
    ),
    _rule(
        name="unsqueeze-unsqueeze",
        pattern=op.Unsqueeze(op.Unsqueeze(var("x"), optional(const()), name="inner"), optional(const()), name="outer"),
        plan=_plan_unsqueezes,
        build=_build_unsqueezes,
        label="Unsqueeze pair",
        doc="Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, a and b); an inner one read by several Unsqueezes "
        "goes into each",
        exports=("inner",),
    ),
    _rule(
        name="reshape-one-unknown",
        pattern=op.Reshape(var("x"), var("shape", lambda v: not is_constant(v))),
        plan=_plan_one_unknown,
        build=_reshape_x_static,
        label="Reshape",
        doc="Reshape(x, computed s) with one entry not static -> Reshape(x, constant s with -1 there)",
    ),
    _rule(
        name="cast-chain",
        pattern=_pair("Cast"),
        plan=_check_casts,
        build=_build_casts,
        label="Cast chain",
        doc="Cast(Cast(x, T1), T2) -> Cast(x, T2) (or x) when the first Cast is lossless",
    ),
    CAST_TO_SAME_TYPE,
    _rule(
        name="slice-slice",
        pattern=_SLICES,
        plan=_plan_slices,
        build=_build_slices,
        min_opset=10,
        label="Slice pair",
        doc="Slice(Slice(x)) with constant bounds on axes the two do not share -> one Slice; an inner one read by "
        "several such Slices goes into each",
        exports=("inner",),
    ),
)
