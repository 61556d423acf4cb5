"""The fold pass's cost model: does one bigger kernel beat the separate ones plus the copies?

Per fold, the members' kernels (each at its own size) are compared with the folded kernel
(at the total size) plus the copies the fold adds: the Concat (and Transpose) that packs
the activations, the Gather that reorders a fold's slices, the Split (and Squeeze /
Transpose) that cuts slices out for readers outside the chain. A chain of folds is taken
when its total predicted gain is positive at both onnxruntime optimization levels (and at
every batch, below).

Times come from MEASURED, a table of (work, microseconds) per kind of kernel, through a
line fitted to it per kind: a launch overhead plus a time per unit of work. So one bigger
kernel saves the launch overheads of the others; the cache gains of bigger GEMMs are
within the noise of the measurements on a shared machine, and are not counted.

Sizes with symbolic dims are costed at a sequence of 64 (a dim whose name says sequence:
seq, len, token, time, step) and at every batch of BATCHES (any other dim): a chain is taken
only when it gains at each. One batch is not enough: a stacked MatMul fold's grouped Conv
computes the batch as pixels, which onnxruntime's GEMM runs in strips of 16 columns (see
_grouped_conv_work), so a fold that gains at batch 1 can lose at batch 3: wide_ensemble's
chain ran 0.73x the original at batch 1 and 1.50x at batch 3 (ORT_DISABLE_ALL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from graphopt.ir import Dim, Expr, Node, Sym, tensor_shape
from graphopt.passes.fold.index import Fold
from graphopt.passes.fold.plan import SEED_OPS, Spec

__all__ = ["BATCHES", "CALIBRATION", "FITTED", "LEVELS", "MEASURED", "chain_terms", "gains_us", "kernel_us"]

LEVELS = ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL")
# The batches a symbolic batch dim is costed at: one row, and a few (the size of the numerics
# check's first binding), where the grouped Conv's GEMM strips cost the most per row.
BATCHES = (1, 3)

# Measured with benchmarks/fold_costs.py (onnxruntime 1.32.0, CPU provider, 1 thread, the
# project's shared 2-core machine, 2026-11-22): per kind, rows of (work, microseconds of one
# kernel at ORT_ENABLE_ALL, at ORT_DISABLE_ALL), work being multiply-adds for matmul / conv /
# grouped-conv and elements for the others. Each time is the median difference between a
# chain of 8 (op, Relu) steps and a chain of 8 Relus, run interleaved 200 times, divided by
# the kernels in the chain. Where two runs measured one size the smaller time is kept, and
# times are made non-decreasing in work (the machine's noise is larger than the difference
# between neighbours). onnxruntime cancels the Transposes of that chain at ORT_ENABLE_ALL,
# so both levels use the ORT_DISABLE_ALL Transpose times. Memory-bound matrix-vector
# products (one row) make the matmul rows uneven: multiply-adds alone do not say how long a
# MatMul takes.
# The grouped-conv rows are timed at 1 row or a multiple of 16, and channels in 16s, where
# the multiply-adds _grouped_conv_work counts are the same at both levels.
MEASURED: dict[str, tuple[tuple[int, float, float], ...]] = {
    "matmul": (
        (4096, 0.48, 0.47), (32768, 2.92, 2.83), (65536, 5.58, 5.95), (131072, 5.58, 5.95), (196608, 27.95, 27.94),
        (262144, 27.95, 27.94), (4194304, 54.25, 54.64), (8388608, 124.19, 117.43), (12582912, 235.7, 424.38),
        (16777216, 490.17, 498.72), (37748736, 561.34, 556.23), (67108864, 858.17, 857.9),
    ),
    "conv": (
        (50176, 0.83, 1.58), (802816, 8.81, 12.87), (3211264, 34.03, 45.05), (28901376, 328.58, 387.6),
        (33918976, 453.92, 597.63), (51380224, 605.94, 645.94),
    ),
    "grouped-conv": (
        (32768, 1.45, 2.5), (131072, 18.82, 19.4), (4194304, 55.72, 60.09), (8388608, 97.83, 125.83),
        (16777216, 212.8, 220.3),
    ),
    "elementwise": (
        (256, 0.35, 0.38), (2048, 0.67, 0.69), (16384, 2.95, 2.9), (131072, 25.09, 21.76), (1048576, 294.47, 305.98),
    ),
    "gather": (
        (256, 1.21, 1.25), (2048, 6.47, 6.59), (16384, 56.27, 55.98), (131072, 439.31, 441.88),
        (1048576, 3539.95, 3496.74),
    ),
    "transpose": (
        (256, 0.27, 0.27), (2025, 0.46, 0.46), (16384, 4.23, 4.23), (131044, 21.36, 21.36), (1048576, 1837.3, 1837.3),
    ),
    "split-concat": (
        (256, 1.77, 1.8), (2048, 1.96, 1.97), (16384, 5.64, 5.66), (131072, 34.98, 34.79), (1048576, 881.8, 880.85),
    ),
}  # fmt: skip

# Per level, the scales of a fold's two predicted terms: (kernel time saved, copy time spent);
# the kernel times a chain replaces (chain_time_us, what --fold-tolerance compares with) take
# the first. The kernel table above times each kernel alone, in a chain of Relus; in a model
# the effect of a fold is smaller. Fitted by benchmarks/calibrate.py (2026-11-29, onnxruntime
# 1.32.0, 1 thread, the shared 2-core machine at a load average of 6 to 8) to the measured
# effect of 31 fold decisions of the corpus and the real exports: 3 were beyond noise in
# both of two runs, and their signs were all predicted right before. wide_ensemble's chain,
# predicted +7.9 / +8.4 us, measured +1.5 / +3.4 us; whisper_encoder's Q/K/V folds, predicted
# -466 us, measured -19 / -26 ms (a cost outside the model's form: refused either way). One
# scale for both terms, so no decision changes (see BENCHMARKS.md, "Calibrating fold").
CALIBRATION: dict[str, tuple[float, float]] = {"ORT_ENABLE_ALL": (0.178, 0.178), "ORT_DISABLE_ALL": (0.398, 0.398)}

_SEQUENCE_WORDS = ("seq", "len", "token", "time", "step")
_SEQUENCE_GUESS = 64
# MLAS's SGEMM kernel computes 16 columns at a time (x86 and ARM). onnxruntime's NCHWc block
# is 16 channels with AVX-512 and 8 with AVX2: channels that are multiples of 16 are blocked
# on both.
_GEMM_STRIP = 16
_NCHWC_BLOCK = 16


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """A line ``launch + per_unit * work`` through the points, by relative error (small
    kernels weigh as much as big ones); the launch overhead is never negative."""
    works = np.array([w for w, _ in points], dtype=float)
    times = np.array([max(t, 1e-3) for _, t in points], dtype=float)
    system = np.stack([np.ones_like(works), works], axis=1) / times[:, None]
    (launch, per_unit), *_ = np.linalg.lstsq(system, np.ones_like(works), rcond=None)
    if launch < 0:
        launch, per_unit = 0.0, float(np.sum(times * works / times**2) / np.sum(works**2 / times**2))
    return float(launch), float(per_unit)


FITTED = {
    level: {kind: _fit([(row[0], row[1 + column]) for row in rows]) for kind, rows in MEASURED.items()}
    for column, level in enumerate(LEVELS)
}


def kernel_us(level: str, kind: str, work: float) -> float:
    launch, per_unit = FITTED[level][kind]
    return launch + per_unit * work


def _dim(dim: Dim, batch: int) -> int:
    if isinstance(dim, int):
        return dim
    names = [dim.name] if isinstance(dim, Sym) else [str(dim)] if isinstance(dim, Expr) else []
    return _SEQUENCE_GUESS if any(w in n.lower() for n in names for w in _SEQUENCE_WORDS) else batch


def _elements(shape: Sequence[Dim] | None, batch: int) -> int:
    return math.prod(_dim(d, batch) for d in shape) if shape is not None else 1


def _work(node: Node, batch: int) -> float:
    """Multiply-adds of a MatMul / Gemm / Conv, elements of an element-wise op's output."""
    out = _elements(tensor_shape(node.outputs[0]), batch)
    weight = tensor_shape(node.inputs[1]) if len(node.inputs) > 1 else None
    if node.op_type == "MatMul" and weight:
        return out * _dim(weight[0], batch)
    if node.op_type == "Gemm" and weight:
        return out * _dim(weight[1] if node.attr("transB", 0) else weight[0], batch)
    if node.op_type == "Conv" and weight:
        return out * math.prod(_dim(d, batch) for d in weight[1:])
    return out


def _grouped_conv_work(level: str, fold: Fold[Spec], batch: int) -> float:
    """Multiply-adds the grouped 1x1 Conv of a stacked MatMul / Gemm fold computes, its rows
    (the members' leading dims, with the batch) being the Conv's pixels.

    MLAS runs a Conv as one GEMM per group, (output channels x input channels) by (input
    channels x pixels), and computes the pixels in strips of _GEMM_STRIP columns: 3 rows cost
    as much as 16 (one row is a matrix-vector product, costed as it is). At ORT_ENABLE_ALL
    onnxruntime runs the Conv in its blocked NCHWc layout instead, whose kernel is linear in
    the pixels, when the channels of each group are multiples of the block."""
    depth = _dim(tensor_shape(fold.spec.operand.values[0])[-1], batch)  # type: ignore[index]
    width = _dim(fold.spec.layout.member_shapes[0][-1], batch)
    rows = _elements(fold.spec.layout.member_shapes[0][:-1], batch)
    nchwc = level == "ORT_ENABLE_ALL" and depth % _NCHWC_BLOCK == 0 and width % _NCHWC_BLOCK == 0
    if rows > 1 and not nchwc:
        rows = math.ceil(rows / _GEMM_STRIP) * _GEMM_STRIP
    return len(fold.members) * depth * width * rows


def _kind(fold: Fold[Spec], folded: bool) -> str:
    op = fold.members[0].op_type
    if op not in SEED_OPS:
        return "elementwise"
    if op == "Conv":
        return "conv"
    return "grouped-conv" if folded and fold.spec.how == "stacked" else "matmul"


def _seed(fold: Fold[Spec], folds: dict[int, Fold[Spec]]) -> Fold[Spec]:
    """The MatMul / Gemm / Conv fold an element-wise fold continues (itself if none)."""
    while fold.spec.how == "elementwise" and fold.spec.operand.source in folds:
        fold = folds[fold.spec.operand.source]  # type: ignore[index]
    return fold


def _after_conv(fold: Fold[Spec], folds: dict[int, Fold[Spec]]) -> bool:
    seed = _seed(fold, folds)
    return seed.members[0].op_type == "Conv" or seed.spec.layout.kind == "rows"


def _fused_at_all(fold: Fold[Spec], folds: dict[int, Fold[Spec]]) -> bool:
    """onnxruntime (ORT_ENABLE_ALL) fuses a bias Add and an activation into a Conv or 2-D
    Gemm, folded or not: such element-wise folds gain nothing there."""
    seed = _seed(fold, folds)
    if fold.spec.how != "elementwise" or seed is fold:
        return False
    return _after_conv(fold, folds) or len(seed.spec.layout.member_shapes[0]) == 2


def fold_terms(
    level: str, fold: Fold[Spec], folds: dict[int, Fold[Spec]], cut_out: bool, batch: int
) -> tuple[float, float]:
    """Predicted microseconds ``fold`` saves in kernels at ``level`` and ``batch``, and those
    its copies cost."""
    works = [_work(m, batch) for m in fold.members]
    saved = 0.0
    if not (level == "ORT_ENABLE_ALL" and _fused_at_all(fold, folds)):
        kind = _kind(fold, True)
        folded = _grouped_conv_work(level, fold, batch) if kind == "grouped-conv" else sum(works)
        saved = sum(kernel_us(level, _kind(fold, False), w) for w in works) - kernel_us(level, kind, folded)
    copies = 0.0
    operand = fold.spec.operand
    activations = sum(_elements(tensor_shape(v), batch) for v in operand.values)
    if operand.how == "gather":
        copies += kernel_us(level, "gather", activations)
    elif operand.how == "pack":
        copies += kernel_us(level, "split-concat", activations) / 2
        if fold.spec.layout.kind == "rows":
            copies += kernel_us(level, "transpose", activations)
    if cut_out:
        outputs = sum(_elements(shape, batch) for shape in fold.spec.layout.member_shapes)
        copies += kernel_us(level, "split-concat", outputs) / 2
        if fold.spec.layout.kind == "rows":
            copies += kernel_us(level, "transpose", outputs)
        elif level == "ORT_ENABLE_ALL" and _after_conv(fold, folds):
            # onnxruntime keeps Conv outputs in its blocked NCHWc layout, which Split does not
            # read: the fold's tensor is reordered out of it and each slice back into it.
            copies += kernel_us(level, "split-concat", outputs)
    return saved, copies


def chain_time_us(chain: Sequence[Fold[Spec]], batch: int) -> dict[str, float]:
    """Per level, the predicted time of the chain's kernels as they are, unfolded, at ``batch``
    (scaled as the kernel time a fold saves)."""
    return {
        level: CALIBRATION[level][0]
        * sum(kernel_us(level, _kind(f, False), _work(m, batch)) for f in chain for m in f.members)
        for level in LEVELS
    }


def chain_terms(
    chain: Sequence[Fold[Spec]], cut_out: Callable[[Fold[Spec]], bool], batch: int
) -> dict[str, tuple[float, float]]:
    """Per level, the microseconds a chain of folds saves in kernels and spends in copies at
    ``batch``, unscaled."""
    folds = {f.id: f for f in chain}
    found: dict[str, tuple[float, float]] = {}
    for level in LEVELS:
        terms = [fold_terms(level, f, folds, cut_out(f), batch) for f in chain]
        found[level] = (sum(t[0] for t in terms), sum(t[1] for t in terms))
    return found


def gains_us(terms: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per level, the predicted gain of a chain of folds in microseconds (negative: it costs),
    from its terms (chain_terms): the kernels saved less the copies, each scaled by CALIBRATION."""
    return {
        level: CALIBRATION[level][0] * saved - CALIBRATION[level][1] * copies
        for level, (saved, copies) in terms.items()
    }
