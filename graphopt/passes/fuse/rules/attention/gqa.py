"""GroupQueryAttention for ``--target ort``: the MultiHeadAttention ort.py writes on a KV cache's
Concat(past, new) becomes onnxruntime's decoding operator where its CPU kernel computes the
export's attention, behind an If on the dims read at run time where they are not static.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from graphopt.facts.op import SymValue, d_add
from graphopt.ir import DataType, Graph, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._float32 import cached_in_float32
from graphopt.passes.fuse.rules._helpers import float_array
from graphopt.passes.fuse.rules._ort import MS, cpu_float
from graphopt.passes.fuse.rules.attention.builds import expanded_to, off_lowest
from graphopt.passes.fuse.rules.attention.ort import merged_heads
from graphopt.passes.fuse.rules.attention.plans import cache_parts
from graphopt.passes.fuse.rules.attention.spellings import FAMILY
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, chain, either, match, op, optional, var
from graphopt.passes.rewrite.proofs import unrepeated, unsplit

# -- target ort: onnxruntime's GroupQueryAttention for a KV cache -------------------------------------
#
# A decoder with a KV cache, once the rule above wrote its attention, reads
# MultiHeadAttention(Q, repeat(Concat(past_key, K)), repeat(Concat(past_value, V)), attention_bias) with the Concats
# as the present outputs and repeat = Reshape(Expand(Unsqueeze(kv, 2))), grouped-query attention's repeat of the
# K / V heads. That is com.microsoft GroupQueryAttention(Q, K, V (batch, seq, kv heads * head size), past_key,
# past_value (batch, kv heads, past, head size), seqlens_k, total_sequence_length, attention_bias) whose
# present_key / present_value are the Concats (batch, kv heads, past + seq, head size), where its CPU kernel
# (onnxruntime 1.32, float32 and float16, each run in a session) computes what the export does:
#   - seqlens_k is total - 1 for every row and total_sequence_length the key length (past + seq), read from the
#     shapes: then the kernel writes each row's new keys after its whole past, as the Concat does. The form
#     onnxruntime's model builder writes, seqlens_k = ReduceSum(attention_mask) - 1, compacts a padded row's
#     cache (its new keys go after its valid past), which moves the present outputs; the padding stays in the
#     attention bias instead, whichever side it is on;
#   - the kernel masks keys after past + i for query i (causal with the past): the bias must already, so its
#     mask is proven to be the causal band j <= past + i (And any padding), as HF's decoders build it from
#     Range(0, total) over keys and Range(0, seq) + past over queries;
#   - a query whose keys are all masked (a left-padded row's padding in a prompt) gets zeros (float32) or NaN
#     (float16) from the kernel under a -inf fill: the export must zero it as well, with the IsNaN guard after the
#     attention. A finite fill at or below -1e30 (dynamo's finfo.min, raised one step: the kernel reads the lowest
#     float as -inf) weighs such a query's keys alike, the export all of them, the kernel those of its causal
#     window (keys up to past + i), which are all of them for one new token only: so a finite fill is taken for
#     one new token, the -inf fill with the guard for any count;
#   - the kernel refuses batch > 1 with several new tokens and a past ("batch_size must be 1 when
#     sequence_length > 1 and past context is given").
# Against the MultiHeadAttention form (benchmarks/ort_gqa_probe.py, 4 layers of 8 query / 2 kv heads of 32, 1
# thread, ORT_ENABLE_ALL) its kernel ran a decode step in 0.59x (batch 2, past 17), 0.67x (past 256), 0.44x (batch
# 1, past 1024), 8 new tokens after 5 in 0.82x and a 32-token prompt in 0.89x, but a 128-token prompt in 1.04x and
# a 512-token one in 1.12x: ort-group-query-attention takes at most 32 new tokens,
# ort-group-query-attention-any-length (off by default) any count.
# Where these conditions hold for every shape the graph takes (a decode-step graph of one new token, a static batch
# 1), GroupQueryAttention replaces the MultiHeadAttention. Where they depend on dims read at run time (an export with
# dynamic batch, sequence and past serves prompts and decode steps alike), an If on those dims (read once from the
# model's inputs) picks GroupQueryAttention where they hold and the MultiHeadAttention on the Concat caches
# otherwise. What only the caches read (V's head split, K's rotary on its head split) is made again in the branches,
# GroupQueryAttention's on the projections, so a step computes it once. On the llama_kv exports (dynamic batch,
# sequence and past; 1 thread, ORT_ENABLE_ALL, interleaved, against the MultiHeadAttention form) a decode step ran in
# 0.89x to 0.96x (batch 1 after 128, batch 2 after 17 left-padded), prompts of 8 and 16 tokens in 0.95x to 1.02x
# (within the spread: the projections dominate).
# The rotary embedding stays outside the op: do_rotary reads its cos / sin caches at every position position_ids may
# hold (an input the graph does not bound), and the kernel ignores position_ids in a first prompt of several rows.

_KV_AXES = {"key": "k_axes", "value": "v_axes"}
_KV = ("key", "value")


def _kv_cache(name: str) -> Pattern:
    """The ``name`` cache's Concat(past, new), with or without grouped-query attention's repeat of its heads."""
    cache = op.Concat(var(f"past_{name}"), var(f"new_{name}"), name=f"{name}_cache")
    unsqueeze = op.Unsqueeze(cache, optional(var(_KV_AXES[name])), name=f"{name}_unsqueeze")
    expand = op.Expand(unsqueeze, var(f"{name}_wide"), name=f"{name}_expand")
    return either(op.Reshape(expand, var(f"{name}_heads"), name=f"{name}_repeat"), cache)


_GQA = op.MultiHeadAttention(
    var("query"),
    _kv_cache("key"),
    _kv_cache("value"),
    optional(var("projection_bias")),
    optional(var("key_padding_mask")),
    optional(var("attention_bias")),
    domain=MS,
    name="mha",
)


@dataclass(frozen=True)
class _Gate:
    """Which shapes GroupQueryAttention's kernel computes the export's attention at: one new token, or where every
    query row is exact (``every_row``), batch 1 or no past; and at most ``most_tokens`` new tokens (None: any)."""

    every_row: bool
    most_tokens: int | None


@dataclass
class _GqaPlan:
    heads: int
    kv_heads: int
    scale: float | None
    mask: Value  # the Where(cond, 0, fill) under the bias
    gate: _Gate
    at_run_time: bool  # the gate depends on dims read at run time: an If picks GroupQueryAttention or the MHA


# The most new tokens ort-group-query-attention takes (measured faster up to 32, slower from 128: above).
_FASTER_NEW_TOKENS = 32
_ANY_LENGTH = "ort-group-query-attention-any-length"

# A truth known when planning (bool), computed by the graph (a Value, when building), or unknown (planning).
_Truth = bool | Value | None


def _joined(b: Builder | None, op_type: str, x: _Truth, y: _Truth) -> _Truth:
    """``x`` Or / And ``y`` (``op_type``), folded where a side is known."""
    deciding = op_type == "Or"  # the value of either side that decides the result
    if x is deciding or y is deciding:
        return deciding
    if x is (not deciding) or y is (not deciding):
        return y if x is (not deciding) else x
    if b is None or not isinstance(x, Value) or not isinstance(y, Value):
        return None  # a side unknown when planning
    return b.op(op_type, x, y)


def _gated(b: Builder | None, m: Match, gate: _Gate) -> _Truth:
    """Whether the kernel computes the export's attention at the shapes it is run at (see _Gate): known from
    static dims, else unknown (``b`` None) or a boolean the graph computes from the dims (built with ``b``)."""
    query, past_key = m.value("query"), m.value("past_key")

    def dim(value: Value, axis: int, test: str, bound: int) -> _Truth:
        size = (Site.shape(value) or (None,) * 4)[axis]
        if isinstance(size, int):
            return size == bound if test == "Equal" else size < bound
        if b is None:
            return None
        return b.op(test, _dim_read(b, m.site, value, axis), b.constant(np.array([bound], np.int64), "bound"))

    one_token = dim(query, 1, "Equal", 1)
    if not gate.every_row:
        return one_token
    batch_one, no_past = dim(query, 0, "Equal", 1), dim(past_key, 2, "Equal", 0)
    taken = _joined(b, "Or", one_token, _joined(b, "Or", batch_one, no_past))
    most = gate.most_tokens
    return taken if most is None else _joined(b, "And", taken, dim(query, 1, "Less", most + 1))


def _dim_read(b: Builder, site: Site, value: Value, axis: int) -> Value:
    """``value``'s dim ``axis`` as a 1-element shape, read from the first model input that declares the same
    symbolic dim where one does: every layer's read is then the same node, which CSE keeps once."""
    size = (Site.shape(value) or (None,) * (axis + 1))[axis]
    if size is not None and not isinstance(size, int):
        for source in site.model.graph.inputs:
            shape = list(Site.shape(source) or ())
            if size in shape:
                return b.shape(source, shape.index(size), shape.index(size) + 1)
    return b.shape(value, axis, axis + 1)


def _plan_gqa(m: Match, site: Site, *, any_length: bool = False) -> _GqaPlan | Refuse:
    mha = m.node("mha")
    if "projection_bias" in m or "key_padding_mask" in m or set(mha.attributes) - {"num_heads", "scale"}:
        return Refuse(
            "the MultiHeadAttention has a projection bias, a key padding mask or an attribute besides the scale"
        )
    if m.value("past_key").graph is not mha.graph:
        return Refuse("the cache's past is read from an enclosing graph (a gated GroupQueryAttention's fallback)")
    query = m.value("query")
    unsupported = cpu_float(site, query, "GroupQueryAttention")
    if unsupported is not None:
        return Refuse(unsupported)
    caches = [m.node(f"{name}_cache").outputs[0] for name in _KV]
    for name, cache in zip(_KV, caches, strict=True):
        if cache_parts(cache) is None:
            return Refuse(f"the {name}s are not a 4-D cache Concat(past, new) along the sequence axis")
        if f"{name}_repeat" in m and unrepeated(m.node(f"{name}_repeat").outputs[0], site) is not cache:
            return Refuse(f"the {name} heads are not provably repeated in groups (grouped-query attention's repeat)")
    heads = site.int_attr(mha, "num_heads", 0)
    q_shape, past, new = site.shape(query), site.shape(m.value("past_key")), site.shape(m.value("new_key"))
    if q_shape is None or past is None or new is None or len(q_shape) != 3:
        return Refuse("the shapes of Q and the key cache are not known")
    kv_heads, size = past[1], past[3]
    if not isinstance(kv_heads, int) or not isinstance(size, int) or not heads or heads % kv_heads:
        return Refuse("the cache's kv heads and head size are not static, or do not divide the query heads")
    value_past = site.shape(m.value("past_value"))
    if value_past is None or len(value_past) != 4 or (value_past[1], value_past[3]) != (kv_heads, size):
        return Refuse("the value cache's heads and head size are not provably the key cache's")
    if q_shape[2] != heads * size or new[2] is None or new[2] != q_shape[1]:
        return Refuse("Q is not (batch, seq, heads * head size) over the cache's new keys")
    if heads != kv_heads and not ("key_repeat" in m and "value_repeat" in m):
        return Refuse("the query heads are more than the cache's and the K / V heads are not repeated to them")
    if "attention_bias" not in m:
        return Refuse(
            "no attention bias: MultiHeadAttention attends to every key, GroupQueryAttention's kernel is causal"
        )
    mask = _causal_mask(m, site, q_shape[1], past[2])
    if isinstance(mask, Refuse):
        return mask
    every_row = bool(np.isneginf(_fill(mask)))
    capped = _Gate(every_row, _FASTER_NEW_TOKENS)
    if any_length and (not every_row or _gated(None, m, capped) is True):
        return Refuse("the count of new tokens does not matter here: ort-group-query-attention's case")
    gate = _Gate(every_row, None) if any_length else capped
    truth = _gated(None, m, gate)
    if truth is False:
        return Refuse(_gate_refusal(gate, q_shape, past[2]))
    scale = mha.attr("scale")
    return _GqaPlan(heads, kv_heads, None if scale is None else float(scale), mask, gate, truth is None)


def _gate_refusal(gate: _Gate, q_shape: tuple[Any, ...], past_len: Any) -> str:
    """Why no shape of the graph is one the kernel computes the export's attention at."""
    if not gate.every_row:
        return (
            "the mask's fill is finite and the new tokens are not one: a query with every key masked weighs "
            "them all in the export, only the keys up to its own in GroupQueryAttention's kernel"
        )
    if not (q_shape[0] == 1 or q_shape[1] == 1 or past_len == 0):
        return (
            "onnxruntime's CPU GroupQueryAttention refuses batch > 1 with several new tokens and a past: "
            "the shapes are static and none of batch 1, one new token or no past"
        )
    return (
        f"the new tokens are a static count above {_FASTER_NEW_TOKENS} (onnxruntime's GroupQueryAttention "
        f"measured slower on longer prompts; {_ANY_LENGTH} takes them: off by default)"
    )


def _fill(mask: Value) -> float:
    """The fill of the mask ``Where(cond, 0, fill)`` (_causal_mask proved it a scalar)."""
    assert mask.producer is not None
    fill = float_array(mask.producer.inputs[2])
    assert fill is not None
    return float(fill.ravel()[0])


_LOWEST_FILL = -1e30


def _causal_mask(m: Match, site: Site, q_len: Any, past_len: Any) -> Value | Refuse:
    """The attention bias's ``Where(band [and padding], 0, fill)`` with the causal band over the past, or why it is
    not that. A -inf fill's NaN (a query with every key masked) must be zeroed after the attention."""
    bias = m.value("attention_bias")
    where = bias.producer
    if where is not None and where.op_type == "Expand" and where.inputs[0] is not None:
        where = where.inputs[0].producer  # the bias spelled out over queries and keys (MultiHeadAttention's)
    if where is None or where.op_type != "Where" or where.inputs[0] is None:
        return Refuse("the attention bias is not a mask Where(cond, 0, fill)")
    zero, fill = float_array(where.inputs[1]), float_array(where.inputs[2])
    if zero is None or fill is None or zero.size != 1 or fill.size != 1 or float(zero.ravel()[0]) != 0.0:
        return Refuse("the attention bias is not a mask Where(cond, 0, fill)")
    if not np.isneginf(fill.ravel()[0]) and not float(fill.ravel()[0]) <= _LOWEST_FILL:
        # the kernel adds the fill to float32 scores: one above this does not absorb them
        return Refuse(f"the mask's fill is neither -inf nor finite <= {_LOWEST_FILL:g}")
    if np.isneginf(fill.ravel()[0]) and not _zeroed_if_nan(m.root.outputs[0]):
        return Refuse("the attention's NaN (a query with every key masked) is not zeroed after it, as the kernel does")
    # past + seq, not the Concat's declared length: an exporter may name that dim apart
    total = d_add(past_len, q_len)
    facts = site.ctx.facts(site.model)
    if total is None or not _causal_band(where.inputs[0], facts.sym, (q_len, past_len, total)):
        return Refuse("the mask is not provably the causal band over the past (key j <= past + query i)")
    return where.outputs[0]


def _zeroed_if_nan(out: Value) -> bool:
    """Whether every reader of ``out`` is the guard ``Where(IsNaN(out), 0, out)`` (or its IsNaN)."""
    readers = [use.node for use in out.uses()]
    guards = [n for n in readers if n.op_type == "Where" and n.inputs[2] is out and n.inputs[0] is not None]
    for guard in guards:
        check, zero = guard.inputs[0].producer if guard.inputs[0] else None, float_array(guard.inputs[1])
        if check is None or check.op_type != "IsNaN" or check.inputs[0] is not out:
            continue
        if zero is not None and zero.size == 1 and float(zero.ravel()[0]) == 0.0 and not out.is_graph_output:
            return all(n is guard or n is check for n in readers)
    return False


Sym = Callable[[Value], SymValue | None]


def _causal_band(cond: Value, sym: Sym, lengths: tuple[Any, Any, Any]) -> bool:
    """Whether ``cond`` (4-D, queries on axis 2 and keys on axis 3) holds nowhere beyond ``key j <= past + query
    i``, being that band (LessOrEqual(keys, positions) or GreaterOrEqual(positions, keys)) or And of it."""
    node = cond.producer
    if node is None:
        return False
    if node.op_type == "And":
        return any(x is not None and _causal_band(x, sym, lengths) for x in node.inputs)
    if node.op_type not in ("LessOrEqual", "GreaterOrEqual") or None in node.inputs:
        return False
    keys, positions = node.inputs if node.op_type == "LessOrEqual" else reversed(node.inputs)
    q_len, past_len, total = lengths
    assert keys is not None and positions is not None
    return _counts_up(keys, 3, 0, total, sym) and _counts_up(positions, 2, past_len, q_len, sym)


def _counts_up(value: Value, axis: int, start: Any, count: Any, sym: Sym) -> bool:
    """Whether 4-D ``value`` is ``start, start + 1, ..., start + count - 1`` along ``axis`` (1 on the other axes):
    Unsqueeze(Range(start, start + count, 1)) or Unsqueeze(Range(0, count, 1) + start), or, with ``count``
    static, any int tensor of that shape whose values the shape facts know (a decode step's one position)."""
    others = tuple(a for a in range(4) if a != axis)
    inner = _unsqueezed(value, others, sym)
    if inner is not None:
        if _range(inner, sym) == (start, d_add(start, count), 1):
            return True
        node = inner.producer
        if node is not None and node.op_type == "Add":
            for ranged, offset in (node.inputs, reversed(node.inputs)):
                if ranged is not None and offset is not None and _range(ranged, sym) == (0, count, 1):
                    return sym(offset) == (start,)
    wanted = tuple(count if a == axis else 1 for a in range(4))
    if not isinstance(count, int) or Site.shape(value) != wanted:
        return False
    return _contents(value, sym) == tuple(d_add(start, i) for i in range(count))


def _contents(value: Value, sym: Sym) -> tuple[Any, ...] | None:
    """The flattened values of a small int tensor, read through the Reshapes and Unsqueezes that made it (they
    keep the flattened values, so any known value along the run is the answer)."""
    known = chain(("Reshape", "Unsqueeze"), var("known", lambda v: sym(v) is not None))
    for found in match(known, value):
        source = found["known"]
        return sym(source) if isinstance(source, Value) else None
    return None


def _unsqueezed(value: Value, axes: tuple[int, ...], sym: Sym) -> Value | None:
    """x where ``value`` is Unsqueeze(x, ``axes``)."""
    node = value.producer
    if node is None or node.op_type != "Unsqueeze" or node.inputs[0] is None:
        return None
    found = sym(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else node.attr("axes")
    return node.inputs[0] if found is not None and tuple(found) == axes else None


def _range(value: Value, sym: Sym) -> tuple[Any, Any, Any] | None:
    """(start, limit, delta) of a scalar ``Range``, as symbolic values."""
    node = value.producer
    if node is None or node.op_type != "Range" or None in node.inputs:
        return None
    found = [sym(x) for x in node.inputs if x is not None]
    if any(f is None or len(f) != 1 for f in found):
        return None
    return tuple(f[0] for f in found if f is not None)  # type: ignore[return-value]


def _kv_tokens(b: Builder, x: Value, kv_heads: int, site: Site) -> Value:
    """(batch, seq, kv heads * head size) from the cache's new (batch, kv heads, seq, head size): the head split's
    source where it has one, the rotary on it where it is the rotary of one."""
    rotated = _rotated_split(x, kv_heads, site) if len(x.uses()) == 1 else None
    if rotated is not None:
        rotary, source = rotated
        return b.op(
            "RotaryEmbedding", source, *rotary.inputs[1:], domain=MS, **{**rotary.attributes, "num_heads": kv_heads}
        )
    split_source = unsplit(x, kv_heads, site)
    return split_source if split_source is not None else merged_heads(b, x)


def _build_gqa(b: Builder, m: Match, plan: _GqaPlan) -> Value:
    site, query = m.site, m.value("query")
    # read from the model's inputs where they declare the dims, so every layer's are one (after CSE)
    past_len, q_len, batch = (_dim_read(b, site, *read) for read in ((m.value("past_key"), 2), (query, 1), (query, 0)))
    key_len = b.op("Add", past_len, q_len)
    total = b.op("Cast", key_len, to=DataType.INT32)
    seqlens_k = b.op("Expand", b.op("Sub", total, b.constant(np.ones(1, np.int32), "one")), batch)
    # spelled out again (MultiHeadAttention's read its key length from the repeat, which goes with the match), from
    # the same lengths: not from the new keys, which a branch may make again
    q_dim = (site.shape(query) or (None,) * 3)[1]
    key_dim = d_add((site.shape(m.value("past_key")) or (None,) * 4)[2], q_dim)
    bias = expanded_to(b, off_lowest(b, plan.mask, site), (q_dim, lambda: q_len), (key_dim, lambda: key_len))
    lengths = _Lengths(bias, seqlens_k, b.op("Reshape", total, b.constant(np.zeros(0, np.int64), "scalar")))
    if not plan.at_run_time:
        outputs = _gqa(b, m, plan, lengths)
    else:
        taken = _gated(b, m, plan.gate)
        assert isinstance(taken, Value)
        gqa, mha = (
            _branch(b, name, build, m, plan, lengths) for name, build in (("gqa", _gqa), ("mha", _mha_on_cache))
        )
        outputs = b.node("If", taken, outputs=3, then_branch=gqa, else_branch=mha).outputs
    m.export("key_cache", outputs[1])
    m.export("value_cache", outputs[2])
    return outputs[0]


@dataclass(frozen=True)
class _Lengths:
    """What the attention reads besides Q, K, V and the caches, made before an If: the bias, and GroupQueryAttention's
    seqlens_k and total_sequence_length."""

    bias: Value
    seqlens_k: Value
    total: Value


_BranchBuild = Callable[[Builder, Match, _GqaPlan, _Lengths], tuple[Value, ...]]


def _branch(b: Builder, name: str, build: _BranchBuild, m: Match, plan: _GqaPlan, lengths: _Lengths) -> Graph:
    """An If branch whose nodes ``build`` makes (reading the enclosing graph's values) and whose outputs it returns."""
    body = Graph(name=b.names.fresh(name))
    inside = Builder(body, b.names, tag=b.tag, provenance=b.provenance, typer=b.typer, opset=b.opset)
    body.outputs = list(build(inside, m, plan, lengths))
    return body


def _gqa(b: Builder, m: Match, plan: _GqaPlan, lengths: _Lengths) -> tuple[Value, ...]:
    """GroupQueryAttention's output and present key and value."""
    key, value = (_kv_tokens(b, m.value(f"new_{n}"), plan.kv_heads, m.site) for n in _KV)
    caches = (m.value("past_key"), m.value("past_value"))
    scale: dict[str, Any] = {} if plan.scale is None else {"scale": plan.scale}
    node = b.node(
        "GroupQueryAttention",
        *(m.value("query"), key, value, *caches, lengths.seqlens_k, lengths.total),
        None,
        None,
        None,
        lengths.bias,
        domain=MS,
        outputs=3,
        num_heads=plan.heads,
        kv_num_heads=plan.kv_heads,
        **scale,
    )
    return node.outputs


def _mha_on_cache(b: Builder, m: Match, plan: _GqaPlan, lengths: _Lengths) -> tuple[Value, ...]:
    """The matched MultiHeadAttention on its Concat caches (their heads repeated as matched), and the caches."""
    caches, repeated = [], []
    for name in _KV:
        cache = _again(b, m.node(f"{name}_cache"), m.value(f"past_{name}"), _new_tokens(b, m, name, plan.kv_heads))
        heads = cache
        for step in ("unsqueeze", "expand", "repeat"):
            if f"{name}_{step}" in m:
                heads = _again(b, m.node(f"{name}_{step}"), heads, *m.node(f"{name}_{step}").inputs[1:])
        caches.append(cache)
        repeated.append(heads)
    out = _again(b, m.node("mha"), m.value("query"), *repeated, None, None, lengths.bias)
    return (out, *caches)


def _new_tokens(b: Builder, m: Match, name: str, kv_heads: int) -> Value:
    """The cache's new K or V (batch, kv heads, seq, head size). Where only the cache reads it and it is a head
    split (V), or the rotary of one (K), that is made again in the branch: the enclosing graph then no longer makes
    it for GroupQueryAttention, which reads the split's source (llama_kv_ts, a decode step: 4% of its time)."""
    new = m.value(f"new_{name}")
    if len(new.uses()) != 1:
        return new
    rotated = _rotated_split(new, kv_heads, m.site)
    if rotated is not None:
        rotary = rotated[0]
        assert rotary.inputs[0] is not None
        return _again(b, rotary, _split_again(b, rotary.inputs[0]), *rotary.inputs[1:])
    return _split_again(b, new) if unsplit(new, kv_heads, m.site) is not None else new


def _split_again(b: Builder, split: Value) -> Value:
    """The head split Transpose(Reshape(x)) ``split`` (unsplit proved it) made again."""
    transpose = split.producer
    reshape = transpose.inputs[0].producer if transpose is not None and transpose.inputs[0] is not None else None
    assert transpose is not None and reshape is not None
    return _again(b, transpose, _again(b, reshape, *reshape.inputs))


def _rotated_split(new: Value, kv_heads: int, site: Site) -> tuple[Node, Value] | None:
    """(the RotaryEmbedding, x) where ``new`` is com.microsoft RotaryEmbedding of the head split of x (batch, seq,
    kv heads * head size): the op takes x itself with num_heads (ort-rotary-embedding-3d's rewrite)."""
    rotary = new.producer
    if rotary is None or rotary.op_type != "RotaryEmbedding" or rotary.domain != MS or rotary.inputs[0] is None:
        return None
    if rotary.attr("num_heads", 0) not in (0, kv_heads):
        return None
    source = unsplit(rotary.inputs[0], kv_heads, site)
    return None if source is None else (rotary, source)


def _again(b: Builder, node: Node, *inputs: Value | None) -> Value:
    """``node``'s op and attributes on ``inputs``."""
    return b.op(node.op_type, *inputs, domain=node.domain, **node.attributes)


_GQA_RULE = partial(
    Rule,
    family=FAMILY,
    pattern=_GQA,
    build=_build_gqa,
    targets=frozenset({"ort"}),
    label="GroupQueryAttention",
    exports=("key_cache", "value_cache"),
)

RULES: tuple[Rule[Any], ...] = (
    # before the default: where it is enabled, it takes the prompts the default leaves to MultiHeadAttention
    _GQA_RULE(
        name=_ANY_LENGTH,
        plan=partial(_plan_gqa, any_length=True),
        default=False,
        doc="ort-group-query-attention for any count of new tokens (measured slower than MultiHeadAttention on "
        "prompts of 128 tokens and more) -> com.microsoft GroupQueryAttention (target ort)",
    ),
    _GQA_RULE(
        name="ort-group-query-attention",
        plan=_plan_gqa,
        doc="MultiHeadAttention on a KV cache's Concat(past, new) (the K / V heads repeated for grouped-query "
        "attention), its mask the causal band over the past -> com.microsoft GroupQueryAttention with past_key / "
        "past_value in and present_key / present_value out, for one new token, or up to "
        f"{_FASTER_NEW_TOKENS} with batch 1 or no past (a -inf fill); an If on the dims picks it where they are "
        "read at run time (target ort)",
    ),
    # the inputs past_key, past_value and attention_bias
    cached_in_float32("gqa-float32", FAMILY, "GroupQueryAttention", 12, cache=(3, 4), mask=10),
)
