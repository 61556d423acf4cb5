"""Rotary embeddings for ``--target ort``: onnxruntime's com.microsoft RotaryEmbedding.

The rotate-half RoPE that rotary.py proves (same pattern, same plan) becomes
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

import dataclasses

import numpy as np

from graphopt.ir import DataType, Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import shared_reader
from graphopt.passes.fuse.rules._ort import MS
from graphopt.passes.fuse.rules.rotary import FAMILY, ROPE, RotaryPlan, cache_value, plan_rotary
from graphopt.passes.rewrite.engine import Match, Rule, Site

_KERNEL_TYPES = (DataType.FLOAT, DataType.FLOAT16)
_FLAT = "ort_rotary_flat"
_IDS = "ort_rotary_ids"
_DIMS = "ort_rotary_dims"


def _plan_ort(m: Match, site: Site) -> RotaryPlan | str:
    dtype = site.dtype(m.value("x"))
    if dtype not in _KERNEL_TYPES:
        return "onnxruntime's CPU RotaryEmbedding runs float32 and float16 only"
    if any(site.dtype(m.value(name)) != dtype for name in ("cos", "sin")):
        return "cos / sin are not in x's type"
    return plan_rotary(m, site)


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


def _caches(b: Builder, m: Match, plan: RotaryPlan) -> tuple[Value, Value, Value]:
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
    caches = [
        cache_value(b, dataclasses.replace(c, batch_of=None), plan.size, n) for c, n in ((cos, "cos"), (sin, "sin"))
    ]
    flat = [_flat(b, c, half) for c in caches]
    ids = b.constant(np.array([0], np.int64), "offset") if shared else _row_ids(b, caches[0])
    return ids, flat[0], flat[1]


def _build(b: Builder, m: Match, plan: RotaryPlan) -> Value:
    ids, cos, sin = _caches(b, m, plan)
    return b.op("RotaryEmbedding", m.value("x"), ids, cos, sin, domain=MS)


RULES: tuple[Rule, ...] = (
    Rule(
        name="ort-rotary-embedding",
        family=FAMILY,
        pattern=ROPE,
        plan=_plan_ort,
        build=_build,
        targets=frozenset({"ort"}),
        label="RotaryEmbedding",
        doc="x * cos + Concat(-x2, x1) * sin (rotate half) -> com.microsoft RotaryEmbedding (target ort)",
    ),
)
