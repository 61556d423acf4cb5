"""Gather family: table lookups that read less than the table.

A lookup of consecutive rows becomes a Slice of the table:

``Gather(T, Slice(P, s, e, axes, steps))`` with ``P`` the constant ``0, 1, ..., N-1`` (the
``position_ids`` buffer BERT exports slice to the sequence length) and ``T`` a constant of
``N`` rows reads the rows ``P`` would index, so it is ``Slice(T', s, e, axes, steps)`` with
``T'`` the table reshaped to ``P``'s dims followed by its row dims (the same data, stored
once). Slice clamps ``s`` and ``e`` to ``N`` on both sides, so every start, end and step
gives the same rows. A table Cast at run time (float16 weights) is Cast after the Slice,
on the rows read only: one node fewer, and exact.

For the portable target only: onnxruntime's EmbedLayerNormalization (``--target ort``)
reads the position table through its Gather.

A lookup in a widened constant table casts the rows read instead:
``Gather(Cast(T), i) -> Cast(Gather(T, i))``, exact (Cast is element-wise). Why: the file
keeps float16 tables (const-cache does not store them again as float32), so without a
graph optimizer at run time (onnxruntime at ORT_DISABLE_ALL, and most other runtimes) the
whole table is converted on every call: bert_fp16_weights' 8192 x 256 word embeddings for
the 64 rows a call reads. Only for tables of at least ``MIN_TABLE_ROWS`` rows, so that the
rows a call reads are very likely fewer than the table's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import const, either, op, optional, var

FAMILY = "gather"
# Every rule of the family, with the family given once.
_rule = partial(Rule, family=FAMILY)
# Tables this long (vocabularies, position tables) are cast row by row after the lookup.
MIN_TABLE_ROWS = 256


def _over_rows(m: Match, table: np.ndarray) -> bool:
    return Site.int_attr(m.node("gather"), "axis", 0) in (0, -table.ndim)


def _consecutive_rows(m: Match, site: Site) -> tuple[np.ndarray, np.ndarray] | Refuse:
    """The positions ``P`` and the table, when the Slice cuts P along its long axis, or why not."""
    positions = Site.array(m.value("positions"))
    table = Site.array(m.value("table"))
    if positions is None or table is None or table.ndim < 1:
        return Refuse("the table or the positions are not readable constants")
    if positions.dtype.kind not in "iu" or positions.ndim < 1:
        return Refuse("the positions are not integers")
    rows = table.shape[0]
    if positions.size != rows or not np.array_equal(positions.ravel(), np.arange(rows)):
        return Refuse("the positions are not 0, 1, ... over the table's rows")
    if not _over_rows(m, table):
        return Refuse("the Gather is not over rows")
    axes = m.optional("axes")
    if axes is None:
        return (positions, table) if positions.ndim == 1 else Refuse("the Slice names no axes")
    found = Site.array(axes)
    if found is None or found.size != 1:
        return Refuse("the Slice's axes are not one constant axis")
    axis = int(found.ravel()[0]) % positions.ndim
    if positions.shape[axis] != rows:
        return Refuse("the Slice does not cut the positions' long axis")
    return positions, table


def _build_rows(b: Builder, m: Match, plan: tuple[np.ndarray, np.ndarray]) -> Value:
    positions, array = plan
    table = m.value("table")
    shaped = positions.shape + array.shape[1:]
    if shaped != array.shape:
        table = b.constant(np.ascontiguousarray(array.reshape(shaped)), "rows")
    sliced = b.op("Slice", table, m.value("starts"), m.value("ends"), m.optional("axes"), m.optional("steps"))
    if "cast" in m:
        return b.op("Cast", sliced, to=Site.int_attr(m.node("cast"), "to", 0))
    return sliced


def _check_large_table(m: Match, site: Site) -> Refuse | None:
    table = Site.array(m.value("table"))
    to = m.node("cast").attr("to")
    if table is None or table.ndim < 1 or not isinstance(to, int):
        return Refuse("the table is not a readable constant")
    if not _over_rows(m, table):
        return Refuse("the Gather is not over rows")
    if table.shape[0] < MIN_TABLE_ROWS:
        return Refuse(f"the table has fewer than {MIN_TABLE_ROWS} rows")
    return None


def _gather_then_cast(b: Builder, m: Match, plan: None) -> Value:
    rows = b.op("Gather", m.value("table"), m.value("indices"), axis=0)  # the plan admits lookups of rows only
    return b.op("Cast", rows, to=Site.int_attr(m.node("cast"), "to", 0))


RULES: tuple[Rule[Any], ...] = (
    _rule(
        name="gather-consecutive-rows",
        pattern=op.Gather(
            either(const(name="table"), op.Cast(const(name="table"), name="cast")),
            op.Slice(
                const(name="positions"), var("starts"), var("ends"), optional(var("axes")), optional(var("steps"))
            ),
            name="gather",
        ),
        plan=_consecutive_rows,
        build=_build_rows,
        min_opset=10,
        targets=frozenset({"onnx"}),
        label="Gather of consecutive rows",
        doc="Gather(T, Slice(0..N-1, s, e)) -> Slice(T, s, e) (a Cast of T goes after the Slice)",
    ),
    _rule(
        name="gather-before-cast",
        pattern=op.Gather(op.Cast(const(name="table"), name="cast"), var("indices"), name="gather"),
        plan=_check_large_table,
        build=_gather_then_cast,
        label="Gather of a cast table",
        doc="Gather(Cast(T), i) -> Cast(Gather(T, i)) for tables of 256 rows or more",
    ),
)
