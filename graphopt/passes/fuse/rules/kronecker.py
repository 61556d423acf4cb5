"""Kronecker family (a shatter rule): a MatMul by a Kronecker-product weight becomes two
small contractions.

Why: a constant weight ``W = A (x) B`` (``A`` of [m, n], ``B`` of [p, q], ``W`` of [m*p, n*q];
structured layers, Kronecker adapters and the seed's DenseKronecker parameterization store
it dense) multiplies each row of ``x`` in ``m*p*n*q`` steps and stores ``m*p*n*q`` numbers,
where ``x @ (A (x) B)`` is, with ``x`` seen as [..., m, p], ``A^T @ x @ B`` seen as [..., n*q]:
``m*q*(p + n)`` or ``n*p*(m + q)`` steps (the cheaper order is taken) and ``m*n + p*q``
numbers. ``MatMul(x, W)`` -> ``Reshape(MatMul(MatMul(A^T, Reshape(x)), B))`` (or the other
order), only where that saves both multiplications and weight bytes, and only for weights
of at least ``MIN_ELEMENTS``: the two extra kernels cost more than small products save
(measured, onnxruntime CPU, 1 thread, 64 rows: a [128, 128] weight 18.7 -> 24.4 us, a
[256, 256] one 53 -> 32 us, a [1024, 1024] one 872 -> 123 us).

The structure is found numerically: ``W`` reshaped to [m, p, n, q] and permuted to an
[m*n, p*q] matrix has rank one exactly when ``W = A (x) B``. Each split of the rows and
columns is first tested on a few 2x2 minors through the largest entry (cheap, and nearly
every split fails there), then in full: exactly for integers, within a few units in the
last place of the largest entry for floats. Weights over ``MAX_ELEMENTS`` are not examined.
A minor vanishes within a few units in the last place of the two products it compares, not of
the largest entry: a float16 weight with an outlier (vit_small_timm's) had every minor of its
ordinary entries within 8 float16 ulps of the outlier, so every split went to the full test, for
every MatMul at every fuse round: 93 of the 129 s of its default run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.ir import Node, Value
from graphopt.ir.constness import constant_tensor
from graphopt.ir.rewrite import Builder
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import op, var

FAMILY = "kronecker"
# The weights examined (elements): from where factoring paid in the measurements above, up
# to a size whose detection stays cheap (it reads the weight whole once per split that
# survives the sampled minors).
MIN_ELEMENTS = 1 << 16
MAX_ELEMENTS = 1 << 22
# The 2x2 minors sampled per split before a full test.
SAMPLES = 24
# Float tolerance, in units of the weight type's epsilon times its largest magnitude.
ULPS = 8


@dataclass(frozen=True)
class Factors:
    """``W = a (x) b``; ``steps`` multiplications per row of x, ``a_first``: the order."""

    a: np.ndarray
    b: np.ndarray
    steps: int
    a_first: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        (m, n), (p, q) = self.a.shape, self.b.shape
        return m, n, p, q


def _divisors(size: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(size) + 1) if size % d == 0]
    return sorted({*small, *(size // d for d in small)})


def _splits(rows: int, cols: int) -> list[tuple[int, int, int, int, int, bool]]:
    """Every nontrivial split (m, n, p, q) of a [rows, cols] weight with its cheaper order's
    cost, cheapest first."""
    found = []
    for p in _divisors(rows):
        for q in _divisors(cols):
            m, n = rows // p, cols // q
            if (m, n) == (1, 1) or (p, q) == (1, 1):
                continue
            b_first, a_first = m * q * (p + n), n * p * (m + q)
            found.append((min(a_first, b_first), m, n, p, q, a_first < b_first))
    return sorted(found)


def _tolerance(w: np.ndarray, scale: float) -> float:
    return 0.0 if w.dtype.kind in "iu" else ULPS * float(np.finfo(w.dtype).eps) * scale


def _minor_limits(w: np.ndarray) -> tuple[float, float]:
    """How far a sampled minor may be from 0: relative to the two products it compares (ULPS units in the last place
    of each), and, as a share of the pivot, an absolute floor for subnormal entries; both 0 for integers."""
    if w.dtype.kind in "iu":
        return 0.0, 0.0
    info = np.finfo(w.dtype)
    return ULPS * float(info.eps), ULPS * float(info.smallest_subnormal)


def _samples(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows and columns of the sampled minors' entries, the same for every split of a weight."""
    rng = np.random.default_rng(rows * 7919 + cols)
    return rng.integers(0, rows, SAMPLES), rng.integers(0, cols, SAMPLES)


def _minors_vanish(
    w: np.ndarray,
    p: int,
    q: int,
    pivot: tuple[int, int],
    limits: tuple[float, float],
    samples: tuple[np.ndarray, np.ndarray],
) -> bool:
    """The sampled 2x2 minors of the [m*n, p*q] rearrangement through ``pivot`` vanish."""
    r, c = samples
    r0, c0 = pivot
    # One minor in plain Python first: a weight without the structure fails it at almost
    # every split, for a microsecond instead of a dozen numpy calls.
    relative, floor = limits
    ri, ci = int(r[0]), int(c[0])
    pivot_value = float(w[r0, c0])
    floor *= abs(pivot_value)
    block = float(w[(ri // p) * p + r0 % p, (ci // q) * q + c0 % q])
    entry = float(w[(r0 // p) * p + ri % p, (c0 // q) * q + ci % q])
    product, crossed = float(w[ri, ci]) * pivot_value, block * entry
    if abs(product - crossed) > relative * (abs(product) + abs(crossed)) + floor:
        return False
    same_block = w[(r // p) * p + r0 % p, (c // q) * q + c0 % q].astype(np.float64)
    same_entry = w[(r0 // p) * p + r % p, (c0 // q) * q + c % q].astype(np.float64)
    products, crossings = w[r, c].astype(np.float64) * pivot_value, same_block * same_entry
    return bool(np.all(np.abs(products - crossings) <= relative * (np.abs(products) + np.abs(crossings)) + floor))


def _factor(
    w: np.ndarray, m: int, n: int, p: int, q: int, pivot: tuple[int, int], tol: float
) -> tuple[np.ndarray, np.ndarray] | None:
    """(A, B) with ``w == A (x) B`` for this split, or None."""
    blocks = w.reshape(m, p, n, q).transpose(0, 2, 1, 3).reshape(m * n, p * q)
    r0, c0 = pivot
    row, col = (r0 // p) * n + c0 // q, (r0 % p) * q + c0 % q
    exact = w.dtype.kind in "iu"
    if exact:
        entries = blocks[row].astype(np.int64)
        divisor = int(np.gcd.reduce(np.abs(entries))) * (1 if entries[col] > 0 else -1)
        b = entries // divisor
        a, remainder = np.divmod(blocks[:, col].astype(np.int64), b[col])
        if np.any(remainder) or not np.array_equal(np.outer(a, b), blocks):
            return None
    else:
        b = blocks[row].astype(np.float64) / float(blocks[row, col])
        a = blocks[:, col].astype(np.float64)
        if np.max(np.abs(np.outer(a, b) - blocks)) > tol:
            return None
    return a.reshape(m, n).astype(w.dtype), b.reshape(p, q).astype(w.dtype)


def _sampled_splits(w: np.ndarray) -> Iterator[tuple[int, int, int, int, int, bool, tuple[int, int], float]]:
    """The splits of ``w`` whose sampled minors vanish, cheapest first, with the pivot and
    tolerance the full test takes; none for a weight the factoring does not examine."""
    if w.ndim != 2 or not MIN_ELEMENTS <= w.size <= MAX_ELEMENTS or w.dtype.kind not in "fiu":
        return
    flat = int(np.argmax(np.abs(w)))
    pivot = (flat // w.shape[1], flat % w.shape[1])
    if w[pivot] == 0:
        return
    tol, limits, samples = _tolerance(w, abs(float(w[pivot]))), _minor_limits(w), _samples(*w.shape)
    for steps, m, n, p, q, a_first in _splits(*w.shape):
        if _minors_vanish(w, p, q, pivot, limits, samples):
            yield steps, m, n, p, q, a_first, pivot, tol


def kronecker_factors(w: np.ndarray) -> Factors | None:
    """The cheapest nontrivial ``W = A (x) B`` of a 2-D weight (None: there is none)."""
    for steps, m, n, p, q, a_first, pivot, tol in _sampled_splits(w):
        found = _factor(w, m, n, p, q, pivot, tol)
        if found is not None:
            return Factors(found[0], found[1], steps, a_first)
    return None


def _weight(node: Node) -> np.ndarray | None:
    weight = Site.array(node.input(1), limit=MAX_ELEMENTS)
    return None if weight is None else np.asarray(weight)  # a plain array indexes faster than a memory map


def _may_factor(node: Node) -> bool:
    """The pattern's test: some split of the constant weight passes the sampled minors (a
    weight without the structure fails them at once, and is no near miss). The engine asks it of
    every MatMul at every fuse round, and the minors read the weight: the answer is remembered
    with the weight's values (bert_small's 16 weights were screened 192 times, a quarter of its run)."""
    tensor = constant_tensor(node.input(1))
    if tensor is None or tensor.size > MAX_ELEMENTS:
        return False
    return tensor.remembered(FAMILY, lambda: _screened(node))


def _screened(node: Node) -> bool:
    weight = _weight(node)
    return weight is not None and next(_sampled_splits(weight), None) is not None


def _plan(m: Match, site: Site) -> tuple[Factors, int] | Refuse:
    """The factors and x's rank, or why the MatMul stays."""
    weight = _weight(m.root)
    factors = None if weight is None else kronecker_factors(weight)
    if factors is None:
        return Refuse("the weight's sampled minors vanish, but it does not factor exactly")
    m_rows, n, p, q = factors.shape
    size = m_rows * p * n * q  # W's elements, and the multiplications per row of x
    if factors.steps >= size or factors.a.size + factors.b.size >= size:
        return Refuse(f"W = A {m_rows}x{n} (x) B {p}x{q}, but two contractions save no multiplications")
    rank = site.rank(m.value("x"))
    if rank is None:
        return Refuse("x has no known rank")
    return factors, rank


def _build(b: Builder, m: Match, plan: tuple[Factors, int]) -> Value:
    factors, rank = plan
    m_rows, n, p, q = factors.shape
    keep = [0] * (rank - 1)  # Reshape's 0 copies the leading dims
    x = b.op("Reshape", m.value("x"), b.constant(np.asarray([*keep, m_rows, p], dtype=np.int64), "kron_in_shape"))
    a_t = b.constant(np.ascontiguousarray(factors.a.T), "kron_a_t")
    small = b.constant(np.ascontiguousarray(factors.b), "kron_b")
    if factors.a_first:
        y = b.op("MatMul", b.op("MatMul", a_t, x), small)
    else:
        y = b.op("MatMul", a_t, b.op("MatMul", x, small))
    return b.op("Reshape", y, b.constant(np.asarray([*keep, n * q], dtype=np.int64), "kron_out_shape"))


RULES: tuple[Rule[Any], ...] = (
    Rule(
        name="kronecker-matmul",
        family=FAMILY,
        pattern=op.MatMul(var("x"), var("w"), where=_may_factor),
        plan=_plan,
        build=_build,
        kind="shatter",
        label="Kronecker MatMul",
        doc="MatMul(x, A (x) B) with a constant Kronecker-product weight -> two small MatMuls between Reshapes",
    ),
)
