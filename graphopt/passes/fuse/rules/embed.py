"""Embedding family (``--target ort``): BERT's embedding layer -> EmbedLayerNormalization.

``LayerNormalization(word[ids] + position[0..S-1] (+ segment[segment_ids]))`` becomes
onnxruntime's ``EmbedLayerNormalization`` (com.microsoft; its CPU provider runs it). The
sum may be nested either way; the position term is the one whose indices are provably
``0 .. S-1`` (a constant, or the exporter's ``position_ids[:, :S]`` Slice of a constant
``arange`` with S the ids' sequence dim), as the op computes position embeddings itself when
no position_ids are given. A constant row added instead of a segment lookup (a lookup of
all-zero segment ids, folded earlier) goes into the position table. The op takes int32 ids:
int64 ids get one Cast to int32, as onnxruntime's own fusion inserts (ids are vocabulary
indices, far below 2^31). The op's mask_index output is required but not read.

Off by default (``enable = ["embed"]`` turns it on): on bert_small (1 thread, seq 64,
interleaved runs) ``--target ort`` with it ran at x1.055 - x1.067 of the original at
ORT_ENABLE_ALL against x0.966 - x0.990 without it (onnxruntime fuses the original's
embeddings itself there); at ORT_DISABLE_ALL it changed nothing measurable (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import shared_reader
from graphopt.passes.fuse.rules._ort import MS
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import OpPattern, const, either, op, optional, var

FAMILY = "embed"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY)
_IDS = (DataType.INT32, DataType.INT64)


def _lookup(name: str) -> OpPattern:
    return op.Gather(const(name=f"{name}_table"), var(f"{name}_ids"), name=name, axis=lambda a: a in (None, 0))


_EXTRA = either(_lookup("segment"), const(name="row"))
_SUM = either(
    op.Add(op.Add(_lookup("word"), _EXTRA, name="inner"), _lookup("position"), name="sum"),
    op.Add(op.Add(_lookup("word"), _lookup("position"), name="inner"), _EXTRA, name="sum"),
    op.Add(_lookup("word"), _lookup("position"), name="sum"),
)
_EMBED = op.LayerNormalization(_SUM, var("gamma"), optional(var("beta")), name="ln")


def _arange_positions(value: Value, site: Site, seq: object) -> bool:
    """Whether ``value`` holds ``0 .. seq-1`` as (1, seq) or (seq,)."""
    array = Site.array(value)
    if array is not None:
        return array.ndim in (1, 2) and array.size == seq and np.array_equal(array.ravel(), np.arange(array.size))
    node = value.producer
    if node is None or node.op_type != "Slice" or not node.in_standard_domain or len(node.inputs) < 4:
        return False
    table = Site.array(node.input(0))
    if (
        table is None
        or table.ndim != 2
        or table.shape[0] != 1
        or not np.array_equal(table[0], np.arange(table.shape[1]))
    ):
        return False
    facts = site.ctx.facts(site.model)
    bounds = [facts.sym(v) if v is not None else None for v in node.inputs[1:5]]
    starts, ends, axes = bounds[0], bounds[1], bounds[2]
    steps = bounds[3] if len(bounds) > 3 and bounds[3] is not None else (1,)
    return starts == (0,) and ends == (seq,) and axes in ((1,), (-1,)) and steps == (1,)


@dataclass
class _Plan:
    ids: Value
    segment_ids: Value | None
    position_table: np.ndarray | None  # the position table with a constant row folded in
    eps: float


def _plan(m: Match, site: Site) -> _Plan | Refuse:
    ln = m.node("ln")
    if ln.attr("axis", -1) not in (-1, 2) or any(v.is_used() for v in ln.outputs[1:]):
        return Refuse("the LayerNormalization is not over the last axis alone")
    ids = m.value("word_ids")
    shape = site.shape(ids)
    if site.dtype(ids) not in _IDS or shape is None or len(shape) != 2 or None in shape:
        return Refuse("the ids are not 2-D int32 / int64 of known shape")
    tables = [Site.array(m.value(f"{n}_table")) for n in ("word", "position", "segment") if f"{n}_table" in m]
    hidden = tables[0].shape[-1] if tables[0] is not None else None
    if any(t is None or t.ndim != 2 or t.dtype != np.float32 or t.shape[1] != hidden for t in tables):
        return Refuse("the embedding tables are not float32 constants of one hidden size")
    if not _arange_positions(m.value("position_ids"), site, shape[1]):
        return Refuse("the position ids are not provably 0 .. S-1 over the ids' sequence")
    segment_ids = m.optional("segment_ids")
    if segment_ids is not None and (site.dtype(segment_ids) not in _IDS or site.shape(segment_ids) != shape):
        return Refuse("the segment ids are not int32 / int64 of the ids' shape")
    for name in ("gamma", "beta"):
        if name in m and (site.shape(m.value(name)) != (hidden,) or site.dtype(m.value(name)) != DataType.FLOAT):
            return Refuse(f"{name} is not a float32 vector over the hidden size")
    position_table = None
    if "row" in m:
        row = Site.array(m.value("row"))
        if row is None or row.dtype != np.float32 or row.size != hidden or row.shape[-1] != hidden:
            return Refuse("the constant added to the embeddings is not one row over the hidden size")
        position_table = tables[1] + row.reshape(1, -1)
    return _Plan(ids, segment_ids, position_table, Site.float_attr(ln, "epsilon", 1e-5))


_INT32_IDS = "embed_ids_int32"


def _int32(b: Builder, ids: Value) -> Value:
    """``ids`` as int32: itself, or one Cast shared by every reader."""
    if Site.dtype(ids) == DataType.INT32:
        return ids
    return shared_reader(ids, _INT32_IDS, lambda: b.op("Cast", ids, to=DataType.INT32, name=_INT32_IDS))


def _build(b: Builder, m: Match, plan: _Plan) -> Value:
    position = m.value("position_table")
    if plan.position_table is not None:
        position = b.constant(plan.position_table, "position_embedding")
    beta = m.optional("beta")
    if beta is None:
        hidden = (Site.shape(m.value("gamma")) or (0,))[0]
        beta = b.constant(np.zeros(int(hidden or 0), np.float32), "ln_bias")
    segment = m.optional("segment_ids")
    node = b.node(
        "EmbedLayerNormalization",
        _int32(b, plan.ids),
        None if segment is None else _int32(b, segment),
        m.value("word_table"),
        position,
        m.optional("segment_table"),
        m.value("gamma"),
        beta,
        domain=MS,
        outputs=2,  # mask_index is not optional in the schema
        epsilon=plan.eps,
    )
    return node.outputs[0]


RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="ort-embedlayernorm",
        pattern=_EMBED,
        plan=_plan,
        build=_build,
        targets=frozenset({"ort"}),
        default=False,
        label="EmbedLayerNorm",
        doc="LayerNormalization(word[ids] + position[0..S-1] (+ segment[ids])) -> com.microsoft "
        "EmbedLayerNormalization (target ort)",
    ),
)
