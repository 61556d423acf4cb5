"""Proofs over the shape facts the rule families share, taking values and nodes, never a match.

What a Reshape does to the dims: a head split (batch, seq, heads * head size) -> (batch, seq, heads, head size),
batch and heads merged to one dim and split again, the merge back to (batch, seq, heads * head size), a target
that keeps its input's dims (static, symbolic, or read back from the exporters' Shape / Gather plumbing), a
constant target with its copied dims spelled out, a Reshape back to its source's shape (a group norm's merge); a
scalar of a rank; K and V as attention reads them (K from K^T, K and V without grouped-query attention's head
repeat); a projection ``MatMul(x, W) + bias`` that matmul-add-gemm-projection writes as one Gemm (which the GELU
rules leave its bias to) unless onnxruntime folds x's Transpose or scalar scale into the MatMul; and a GELU whose
closing half is still to come.

Each proof answers None (or False, or a reason) where the facts do not prove it, and a rule refuses then. The
attention rules (rules/attention/), the shape rules (rules/shape.py), the group norm (rules/norm/), the matmul
rules (rules/matmul/) and the activation rules (rules/activation.py) read them;
tests/passes/test_proofs.py holds their own tests.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.dims import mul
from graphopt.passes.rewrite.engine import Refuse, Site
from graphopt.passes.rewrite.patterns import const, either, match, op, optional, var

# The head split's and merge's Transpose: (batch, seq, heads, head size) <-> (batch, heads, seq, head size).
HEADS = [0, 2, 1, 3]


def ints_of(site: Site, value: Value | None) -> tuple[Any, ...] | None:
    """A small int tensor's entries (ints or symbolic dims), as the shape facts know them."""
    return None if value is None else site.ctx.facts(site.model).sym(value)


# -- head splits ---------------------------------------------------------------------------------------------


def head_count(value: Value, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of a 4-D (batch, heads, seq, head size) value: from its shape, or from the
    head split Transpose(Reshape(x, (B, S, H or -1, d)), [0, 2, 1, 3]) that made it."""
    return _counts(value, site, heads_axis=1)


def split_count(split: Value, site: Site) -> tuple[int, int] | None:
    """(heads, head size) of a head split (batch, seq, heads, head size): from its shape, or from its
    Reshape's target with the heads given or -1 (then the hidden size of x fixes them)."""
    return _counts(split, site, heads_axis=2)


def _counts(value: Value, site: Site, heads_axis: int) -> tuple[int, int] | None:
    shape = Site.shape(value)
    if shape is None or len(shape) != 4:
        return None
    if isinstance(shape[heads_axis], int) and isinstance(shape[3], int):
        return shape[heads_axis], shape[3]
    node = value.producer
    if node is None or node.inputs[0] is None:
        return None
    if heads_axis == 1:  # the Transpose of a head split
        return split_count(node.inputs[0], site) if node.op_type == "Transpose" and node.attr("perm") == HEADS else None
    if node.op_type != "Reshape":
        return None
    target, source = ints_of(site, node.inputs[1]), Site.shape(node.inputs[0])
    if target is None or len(target) != 4 or not isinstance(target[3], int) or target[3] <= 0:
        return None
    heads, size = target[2], target[3]
    if isinstance(heads, int) and heads > 0:
        return heads, size
    width = source[-1] if source is not None and len(source) == 3 else None
    if heads != -1 or not isinstance(width, int) or width % size or source is None:
        return None
    zero_copies = not node.attr("allowzero", 0)
    leading = all((t == 0 and zero_copies) or t == d for t, d in zip(target[:2], source[:2], strict=True))
    return (width // size, size) if leading else None


def static_split(split: Node) -> tuple[int, int] | None:
    """(heads, head size) of the head split Reshape ``split`` of a 3-D value, from its output's static last two
    dims alone."""
    shape = Site.shape(split.outputs[0])
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    if Site.rank(split.inputs[0]) != 3:
        return None
    return int(shape[2]), int(shape[3])


def split_source(split: Value, site: Site) -> Value | None:
    """x of a head split Reshape(x (B, S, H * d), (B, S, H, d)), or None."""
    node = split.producer
    if node is None or node.op_type != "Reshape" or node.inputs[0] is None or site.rank(node.inputs[0]) != 3:
        return None
    return node.inputs[0] if split_count(split, site) is not None else None


def unsplit(value: Value, heads: int, site: Site) -> Value | None:
    """x when ``value`` is Transpose(Reshape(x, (B, S, heads, d)), [0, 2, 1, 3]), else None."""
    node = value.producer
    if node is None or node.op_type != "Transpose" or node.attr("perm") != HEADS or node.inputs[0] is None:
        return None
    counts = split_count(node.inputs[0], site)
    return split_source(node.inputs[0], site) if counts is not None and counts[0] == heads else None


# -- merged heads: (batch, heads, X, Y) <-> (batch * heads, X, Y) ----------------------------------------------


def merged_source(merged: Value, heads: int | None) -> Value | None:
    """x (batch, heads, X, Y) when ``merged`` is Reshape(x) to (batch * heads, X, Y) (with ``heads`` when given)."""
    node = merged.producer
    x = node.inputs[0] if node is not None and node.op_type == "Reshape" else None
    source, out = Site.shape(x), Site.shape(merged)
    if x is None or source is None or out is None or len(source) != 4 or len(out) != 3:
        return None
    if not isinstance(source[1], int) or (heads is not None and source[1] != heads) or None in source[:2]:
        return None
    kept = (out[1] is not None and out[1] == source[2]) or (out[2] is not None and out[2] == source[3])
    return x if out[0] is not None and out[0] == mul(source[0], source[1]) and kept else None


def splits_merged_heads(node: Node, heads: int) -> bool:
    """Whether ``node`` is a Reshape of (batch * heads, X, Y) to (batch, heads, X, Y)."""
    source, out = Site.shape(node.inputs[0]), Site.shape(node.outputs[0])
    if node.op_type != "Reshape" or source is None or out is None or len(source) != 3 or len(out) != 4:
        return False
    if out[1] != heads or None in out[:2] or source[0] is None or source[0] != mul(out[0], out[1]):
        return False
    return (out[2] is not None and out[2] == source[1]) or (out[3] is not None and out[3] == source[2])


# -- the merge back: Reshape((batch, seq, heads, head size), (batch, seq, heads * head size)) --------------------


def read_dim(entry: Value | None, source: Value) -> int | None:
    """i when ``entry`` is the i-th dim of ``source`` as a 1-element shape read from it:
    Shape(source, start=i, end=i + 1), or Unsqueeze(Gather(Shape(source), i))."""
    node = entry.producer if entry is not None else None
    if node is not None and node.op_type == "Shape" and node.inputs[0] is source:
        start, end = node.attr("start", 0), node.attr("end")
        return int(start) if end is not None and int(end) == int(start) + 1 and start >= 0 else None
    gather = node.inputs[0].producer if node is not None and node.op_type == "Unsqueeze" and node.inputs[0] else None
    if gather is None or gather.op_type != "Gather" or gather.inputs[0] is None or gather.attr("axis", 0) != 0:
        return None
    shape = gather.inputs[0].producer
    index = Site.array(gather.inputs[1]) if len(gather.inputs) > 1 else None
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not source or shape.attributes:
        return None
    return int(index) if index is not None and index.size == 1 and index.ndim == 0 else None


def merge_refusal(merge: Node, site: Site, width: int, batch: object, seq: object) -> str | None:
    """Why the Reshape ``merge`` of (batch, seq, heads, head size) is not provably to (batch, seq, width), or None."""
    target = ints_of(site, merge.inputs[1])
    copies = not merge.attr("allowzero", 0)  # a 0 entry copies the input's dim
    wrong = "the merge Reshape is not provably back to (batch, seq, heads * head size)"
    if target is None or len(target) != 3 or target[2] not in (width, -1) or (0 in target and not copies):
        return wrong
    kept_batch, kept_seq = (_kept(merge, target, axis, dim) for axis, dim in ((0, batch), (1, seq)))
    # With the width fixed, one of batch and seq provably kept fixes the other.
    if not (kept_batch and kept_seq) and not ((kept_batch or kept_seq) and target[2] == width):
        return wrong
    return None


def _kept(merge: Node, target: tuple[Any, ...], axis: int, dim: object) -> bool:
    """Whether the merge's target keeps ``axis`` of its (batch, seq, heads, head size) input: a 0 (a copy),
    the dim ``dim`` the facts know, or that dim read from the merge's own input (TorchScript's
    Shape / Gather / Unsqueeze, whose value the facts may not know)."""
    if target[axis] == 0 or (target[axis] is not None and target[axis] == dim):
        return True
    merged, concat = merge.inputs[0], merge.inputs[1].producer if merge.inputs[1] is not None else None
    if merged is None or concat is None or concat.op_type != "Concat" or len(concat.inputs) != len(target):
        return False
    return read_dim(concat.inputs[axis], merged) == axis


# -- Reshape targets -------------------------------------------------------------------------------------------


def reshaped_to_itself(source: Value, target: Value, site: Site, query: Value, *, allowzero: bool = False) -> bool:
    """Whether Reshape(source, target) keeps the shape of ``source``, the product P V of an attention
    whose Q is ``query``: each entry of ``target`` (a Concat) is source's own dim there (the batch and
    query length may also be Q's), read from it or provably equal to it, with at most one -1; or the
    target is known and each entry is source's static dim there, a 0 that copies it (not ``allowzero``),
    or the one -1 (the shape rules spell a target so)."""
    dims, concat = site.shape(source), target.producer
    kept = ints_of(site, target)
    if dims is not None and kept is not None and len(kept) == len(dims):
        copied = [want == have or (want == 0 and not allowzero) for want, have in zip(kept, dims, strict=True)]
        unknown = [axis for axis, want in enumerate(kept) if want == -1]
        if len(unknown) <= 1 and all(copied[axis] or axis in unknown for axis in range(len(dims))):
            return True
    if dims is None or concat is None or concat.op_type != "Concat" or len(concat.inputs) != len(dims):
        return False
    free = 0
    for axis, entry in enumerate(concat.inputs):
        value = Site.array(entry)
        if value is not None and value.size == 1 and int(value.ravel()[0]) == -1:
            free += 1
            continue
        read = read_dim(entry, source) == axis or (axis in (0, 2) and read_dim(entry, query) == axis)
        known = ints_of(site, entry) if entry is not None else None
        same = [dims[axis], *((site.shape(query) or (None,) * 4)[axis : axis + 1] if axis in (0, 2) else ())]
        if not (read or (known is not None and len(known) == 1 and known[0] is not None and known[0] in same)):
            return False
    return free <= 1


def reshaped_back(merge: Node, source: Value, site: Site, kept: Collection[int]) -> bool:
    """Whether the Reshape ``merge`` of a value holding as many elements as ``source`` (and source's own dims at
    the axes ``kept``) provably gives ``source``'s shape: its target is Shape(source), or each entry is source's dim
    there (as the facts know it, or read from source by Shape / Gather plumbing), a 0 copying a kept axis, or the
    one -1 (the element count fixes it). Dims of source the facts do not know are proved only by reading them."""
    target, dims = merge.inputs[1], site.shape(source)
    node = target.producer if target is not None else None
    if node is not None and node.op_type == "Shape" and node.inputs[0] is source and node.attr("start", 0) == 0:
        end = node.attr("end")
        if end is None or (dims is not None and int(end) >= len(dims)):
            return True
    entries = target_entries(site, target, len(dims)) if dims is not None else None
    if dims is None or entries is None:
        return False
    copies, free = not merge.attr("allowzero", 0), 0
    for axis, (entry, dim) in enumerate(zip(entries, dims, strict=True)):
        if entry == -1:
            free += 1
        elif not (
            (entry == 0 and copies and axis in kept)
            or (entry is not None and dim is not None and entry == dim)
            or reads_dim(target, axis, source, len(dims))
        ):
            return False
    return free <= 1


def target_entries(site: Site, target: Value | None, rank: int) -> list[Any] | None:
    """The ``rank`` entries of a Reshape target as the facts know them, else those of its Concat of one-element
    pieces that are constants (None for the others); None when neither gives ``rank`` entries."""
    known = ints_of(site, target)
    if known is not None:
        return list(known) if len(known) == rank else None
    concat = target.producer if target is not None else None
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != rank:
        return None
    pieces = [Site.array(piece) for piece in concat.inputs]
    return [int(p.ravel()[0]) if p is not None and p.size == 1 else None for p in pieces]


def reads_dim(target: Value | None, axis: int, source: Value, rank: int) -> bool:
    """Whether entry ``axis`` of the ``rank`` entries of the Reshape target ``target`` (a Concat of one-element
    pieces) is read from ``source``'s dim ``axis`` (Shape / Gather plumbing)."""
    concat = target.producer if target is not None else None
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != rank:
        return False
    return read_dim(concat.inputs[axis], source) == axis


def spelled_target(reshape: Node, site: Site) -> np.ndarray | Refuse:
    """The Reshape's constant target with each 0 (a copy of a dim of its input, which an earlier input may not
    have) spelled out: the dim itself where the result's type knows it, else -1 when that leaves one -1; or why
    not."""
    shape = Site.array(reshape.inputs[1])
    if shape is None or shape.ndim != 1:
        return Refuse("the target shape is not a constant")
    copies = np.flatnonzero(shape == 0)
    if not copies.size:
        return shape
    result = site.shape(reshape.outputs[0])
    if reshape.attr("allowzero", 0) or result is None or len(result) != len(shape):
        return Refuse("the target copies a dim (0) of unknown size")
    spelled: np.ndarray = shape.copy()
    for index in copies:
        dim = result[index]
        spelled[index] = dim if isinstance(dim, int) and dim > 0 else -1
    if np.count_nonzero(spelled == -1) > 1:
        return Refuse("the target copies a dim (0) and has a -1 besides")
    return spelled


def one_unknown(reshape: Node, site: Site) -> list[int] | Refuse:
    """The Reshape's computed target as constant entries with its one unknown entry as -1, or why not."""
    if reshape.attr("allowzero", 0):
        return Refuse("allowzero Reshape")
    found = ints_of(site, reshape.inputs[1])
    if found is None:
        return Refuse("the target shape is not provable")
    unknown = [i for i, d in enumerate(found) if not isinstance(d, int)]
    if len(unknown) != 1 or any(isinstance(d, int) and d <= 0 for d in found):
        return Refuse("the target shape has more than one entry not provably static and positive")
    return [-1 if i == unknown[0] else int(d) for i, d in enumerate(found)]


def scalar_of_rank(value: Value, rank: int | None) -> bool:
    """Whether ``value``'s shape is all 1s and of at most ``rank`` dims: a reshape of the value it
    broadcasts against leaves the broadcast as it was."""
    shape = Site.shape(value)
    return shape is not None and rank is not None and len(shape) <= rank and all(d == 1 for d in shape)


# -- K and V as attention reads them ---------------------------------------------------------------------------


@dataclass
class Key:
    """K (batch, heads, seq, head size) as an attention input: the value to pass, and the Transpose perm to apply
    to it first."""

    value: Value
    perm: list[int] | None = None


# K^T as the exporters write it: Transpose(k, [0, 1, 3, 2]) or Transpose(K, [0, 2, 3, 1]), or dynamo's
# Reshape(Transpose(Reshape(k, (B*H, S, d)), [0, 2, 1]), (B, H, d, S)).
_KEY_TRANSPOSED = either(
    op.Transpose(var("k"), name="transpose"),
    op.Reshape(op.Transpose(op.Reshape(var("k"), var("merged_shape"), name="merge"), perm=[0, 2, 1]), var("shape")),
)


def untransposed_key(kt: Value) -> Key | None:
    """K (B, H, S, d) from K^T (B, H, d, S) in the exporters' spellings."""
    for found in match(_KEY_TRANSPOSED, kt):
        k, transpose, merge = found["k"], found.get("transpose"), found.get("merge")
        assert isinstance(k, Value)
        if isinstance(transpose, Node):
            perm = list(transpose.attr("perm", []))
            if perm == [0, 1, 3, 2]:
                return Key(k)
            return Key(k, HEADS) if perm == [0, 2, 3, 1] and Site.rank(k) == 4 else None
        assert isinstance(merge, Node)
        dims, out, flat = Site.shape(k), Site.shape(kt), Site.shape(merge.outputs[0])
        if dims is None or out is None or flat is None or len(dims) != 4 or len(flat) != 3 or None in dims:
            return None
        if tuple(flat[1:]) != dims[2:]:
            return None
        return Key(k) if out == (dims[0], dims[1], dims[3], dims[2]) else None
    return None


def merged_key(kt: Value, heads: int) -> Key | None:
    """K (batch, heads, T, d) from the merged K^T: Transpose(merge(K), [0, 2, 1]) or merge(K^T)."""
    node = kt.producer
    if node is not None and node.op_type == "Transpose" and node.attr("perm") == [0, 2, 1] and node.inputs[0]:
        k = merged_source(node.inputs[0], heads)
        return Key(k) if k is not None else None
    k_t = merged_source(kt, heads)
    return untransposed_key(k_t) if k_t is not None else None


# Grouped-query attention's repeat of the K / V heads.
_REPEATED = op.Reshape(
    op.Expand(op.Unsqueeze(var("kv"), optional(var("axes")), name="unsqueeze"), var("wide")),
    var("target"),
    name="reshape",
)


def unrepeated(value: Value, site: Site) -> Value:
    """``value`` without grouped-query attention's repeat of its heads:
    Reshape(Expand(Unsqueeze(kv, [2]), (B, Hkv, n, S, d)), (B, Hkv * n, S, d))."""
    found = next(match(_REPEATED, value), None)
    if found is None:
        return value
    source, unsqueeze, reshape, axes_input = found["kv"], found["unsqueeze"], found["reshape"], found["axes"]
    assert isinstance(source, Value) and isinstance(unsqueeze, Node) and isinstance(reshape, Node)
    assert isinstance(found["wide"], Value) and isinstance(found["target"], Value)
    axes = ints_of(site, axes_input) if isinstance(axes_input, Value) else tuple(unsqueeze.attr("axes", ()))
    kv, wide, target = Site.shape(source), ints_of(site, found["wide"]), ints_of(site, found["target"])
    if axes != (2,) or kv is None or len(kv) != 4 or wide is None or len(wide) != 5 or target is None:
        return value
    repeats, heads, size = wide[2], kv[1], kv[3]
    if not all(isinstance(d, int) for d in (repeats, heads, size)):
        return value
    if len(target) != 4 or target[1] != heads * repeats or target[3] != size or wide[1] not in (1, heads):
        return value
    batch = (target[0] == 0 and not reshape.attr("allowzero", 0)) or target[0] == kv[0]
    # The merge keeps the element count: with batch and seq both provably kept, the Expand cannot
    # have broadcast either (a dim it grows from 1 would not fit), so its unknown entries are fine.
    both = batch and target[2] == kv[2]
    if any(not (w in (1, d) or (w is None and both)) for w, d in zip((wide[0], wide[3], wide[4]), kv[::2] + kv[3:])):
        return value
    # With the heads and head size fixed, one of batch and seq provably right fixes the other.
    if batch or target[2] == kv[2]:
        return source
    return value


# -- projections ----------------------------------------------------------------------------------------------

# MatMul(x, W) + bias of a constant 2-D W: what matmul-add-gemm-projection writes as one Gemm.
PROJECTION = op.Add(op.MatMul(var("x"), const(name="w", rank=2), name="matmul"), const(name="bias"))


def projection_bias(
    x: Value, product: Value, bias: Value, site: Site
) -> tuple[tuple[Any, ...], np.ndarray | None] | Refuse:
    """The product's shape and the bias as a vector when it has a rank above 2 (Gemm's C
    broadcasts to [M, N] from a rank of 2 at most); or why the projection is not one."""
    if site.dtype(x) != DataType.FLOAT:
        return Refuse("not a float32 MatMul (measured on float32 only)")
    folded = _folded_into_matmul(x, site)
    if folded is not None:
        return Refuse(
            f"x is {folded}, which onnxruntime folds into the MatMul as a FusedMatMul (the Reshape to rows would "
            "stand between them)"
        )
    shape, bias_shape = site.shape(product), site.shape(bias)
    if shape is None or len(shape) < 3:
        return Refuse("the product's rank is unknown or below 3 (matmul-add-gemm takes 2-D)")
    if (
        bias_shape is None
        or len(bias_shape) > len(shape)
        or any(d != 1 for d in bias_shape[:-1])
        or bias_shape[-1:] not in ((1,), (shape[-1],), ())
    ):
        return Refuse("the bias is not a vector over the last axis")
    if len(bias_shape) <= 2:
        return shape, None
    found = Site.array(bias)
    return Refuse("the bias is not readable") if found is None else (shape, np.ascontiguousarray(found.reshape(-1)))


def _folded_into_matmul(x: Value, site: Site) -> str | None:
    """What onnxruntime folds into a float32 MatMul reading ``x`` when loading it (its MatMul transpose and scale
    fusions, which write FusedMatMul): ``x``'s Transpose of the last two dims, or its Mul or Div by a scalar
    constant; None where it folds neither."""
    node = x.producer
    if node is None or not node.in_standard_domain:
        return None
    if node.op_type == "Transpose" and not x.is_graph_output:
        perm = node.attr("perm")
        return "a Transpose of its last two dims" if perm is not None and swaps_last_two(perm) else None
    scales = {"Mul": (0, 1), "Div": (1,)}.get(node.op_type, ())
    for side in scales:
        scale, other = Site.array(node.inputs[side]), node.inputs[1 - side]
        rank = site.rank(other)
        # onnxruntime's Gelu fusion takes an erf GELU's closing half first (a tanh GELU it leaves)
        if (
            scale is not None
            and scale.size == 1
            and rank
            and scale.ndim <= rank
            and other is not None
            and not awaits_a_gelu_half(other, ("Erf",))
        ):
            return f"a {node.op_type} by a scalar constant"
    return None


def swaps_last_two(perm: Sequence[int]) -> bool:
    """Whether a Transpose's ``perm`` swaps the last two dims and keeps the others."""
    rank = len(perm)
    return rank >= 2 and list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def awaits_a_gelu_half(x: Value, functions: Collection[str] = ("Erf", "Tanh")) -> bool:
    """Whether ``x`` is ``a * (1 + f(..))`` for f in ``functions``: a GELU whose 0.5 comes last."""
    node = x.producer
    if node is None or node.op_type != "Mul":
        return False
    adds = [v.producer for v in node.inputs if v is not None and v.producer is not None]
    return any(
        add.op_type == "Add"
        and any(v is not None and v.producer is not None and v.producer.op_type in functions for v in add.inputs)
        for add in adds
    )


def projection_target(
    x: Value, product: Value, bias: Value, site: Site
) -> tuple[list[int], np.ndarray | None] | Refuse:
    """The target of the Reshape back to the product's shape, and the bias vector; or why not."""
    found = projection_bias(x, product, bias, site)
    if isinstance(found, Refuse):
        return found
    shape, vector = found
    dynamic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    if len(dynamic) > 1:
        return Refuse("more than one dim of the product is not static (the Reshape back needs a constant target)")
    return [-1 if i == (dynamic or [0])[0] else int(d) for i, d in enumerate(shape)], vector


def projected_as_gemm(total: Value, site: Site) -> bool:
    """Whether ``matmul-add-gemm-projection`` writes ``total``, ``MatMul(x, W) + bias`` of a
    constant 2-D W and a constant bias, as one Gemm."""
    for env in match(PROJECTION, total):
        x, bias, matmul = env["x"], env["bias"], env["matmul"]
        assert isinstance(x, Value) and isinstance(bias, Value) and isinstance(matmul, Node)
        if not isinstance(projection_target(x, matmul.outputs[0], bias, site), Refuse):
            return True
    return False
