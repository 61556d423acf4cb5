"""Comparing one output of the original model (a) with the same output of the optimized one (b).

Metrics, all over the positions where both are finite:

- max abs error ``max |a - b|``; max relative error ``max |a - b| / |a|`` (huge where a is 0:
  reported, never judged);
- relative L2 error ``||a - b|| / ||a||`` and cosine similarity ``<a, b> / (||a|| ||b||)``
  (1.0 when both are all zero);
- the 99th percentile of ``|a - b|``: how far most elements moved, beside the worst one.

float32 and float16 outputs with every element finite are compared in float32 with float64 sums
(_in_float32); the others in float64, a and b divided by their largest magnitude so that squares
cannot overflow.

The default criterion judges the whole tensor: a deep network's rounding moves near-zero
activations by far more than an element-wise rtol allows while the tensor as a whole is
unchanged, which is where onnxsim's allclose gives false alarms (USERS.md, need 1). Its limits
follow the lowest float precision on the output's path (paths.py), whose machine epsilon is
``eps``:

- relative L2 <= max(1e-4, eps / 2) and cosine >= min(0.9999, 1 - that squared): 1e-4 for
  float32 and float64; 4.9e-4 for float16, whose own run-to-run accumulation differences
  reach 1.1e-4 in a plain MatMul; 3.9e-3 for bfloat16;
- or, whatever the relative figures say, every element within an absolute floor of
  4 eps x the output's scale, max(1, max |a|). Activations such as Sigmoid and Softmax
  compute through intermediates near 1, so their results carry absolute rounding at that
  scale: an output that is ~1e-5 everywhere (a detection map, ppocr_v4_det) moves by
  1.2e-7 = 1 float32 eps when a peer merely reorders its arithmetic, a relative L2 error of
  1e-2, and that is rounding, not a bug.

A float output that fails these fixed limits on its figures (not on a shape, a type or a NaN)
gets a second criterion: the original's own rounding (noise.py). The original runs again,
six times, with its float inputs and weights moved by half an eps of its compute precision;
the root mean square of how far that moves the output, in relative L2, is its self-noise, and
the output passes when

- relative L2 <= min(NOISE_FACTOR x self-noise, NOISE_CEILING) = min(3 x self-noise, 3e-2).

The factor 3, from the fixtures of tests/test_check_precision.py (five precisions, a right
rewrite and four seeded wrong ones, two input scales) and graphopt's own output of real
exports in dynamic int8 (BERT, GPT-2, Llama with and without a KV cache, ViT): a right
rewrite moved the output by at most 1.68 x the self-noise (the Llama at 128 tokens: 1.68e-2
against 1.00e-2; moving last bits flips quantization steps, a Poisson-like count), a wrong
one on the fixtures by at least 8.3 x (a wrong attention scale in float16 at input scale 10,
where the residual dilutes it); 3 leaves 1.8x on the one side and 2.8x on the other. The
ceiling 3e-2 holds whatever the self-noise (an original whose runs scatter, a discontinuous
one, cannot open the gate wider): 1.65x above the largest right move measured (1.82e-2,
BERT's pooler output in dynamic int8), about what quantizing those models cost them against
float32 (1.5e-2 for ViT to 4.4e-2 for GPT-2). Where the original's own noise is that large,
an error of its size cannot be told from rounding at that binding (README); every binding
must pass. A model whose self-noise cannot be measured (fewer than four of the six runs
usable) keeps the fixed verdict. The fixed limits stay the first criterion: a float32 model
passes or fails as before, and the extra runs are made only for an output that failed them.

An output that fails the second criterion gets a third, the float reference (reference.py):
the original with its float16 arithmetic, activation Q/DQ rounding and dynamic int8 MatMuls
evaluated in float32. It passes when its relative L2 distance to the reference is no larger
than the original's, or than one of the original's self-noise runs' (those are the original
with its rounding moved: how far the same program lands from the reference by chance). A
rewrite that computes in a higher precision than the original (a fused QDQ attention, an
Attention op in a float16 graph) comes nearer; a wrong one adds an error no quantization error
cancels (the seeded ones on the QDQ int8 fixture: 2.2x to 25x the original's distance). The
reference judges only an original within REFERENCE_CEILING = 0.1 of it, or further where its
own rounding accounts for the distance: within REFERENCE_NOISE_FACTOR = 15 x its self-noise.
One that saturates (a QDQ model fed 10x its calibrated range, 0.75 to 0.77 from it) is no
approximation of it, and its rounding moves it little (self-noise 0.007 to 0.033, 22x to 110x
less); there a wrong attention scale came no further than the original (0.7691 against
0.7692). The QDQ Llama, T5 encoder and GPT-2 (TorchScript) exports are 0.12 to 0.99 from their
reference by their rounding (0.6 to 10.4x their self-noise); a right fusion through Q/DQ brings
them nearer it (0.02 to 0.16). 15 is about the geometric mean of 10.4 and 22. Where the distance
is the original's rounding, a wrong rewrite's own error still moves the output further
(tests/test_check_precision.py, two blocks of sharper attention: the original 0.16 from the
reference, 1.1x its self-noise; the seeded wrong rewrites 0.21 to 0.83).

Where the gate closes, or the optimized output lands further from the reference, one more
proof is tried: that the optimized model is the original's program in float. Its own float
reference (the same evaluation of its float16, Q/DQ and dynamic int8 parts in float32) must
match the original's within the fixed float32 limits (rel L2 1e-4). That proves what no
distance to a saturated reference can: a right fusion through Q/DQ drops only pairs inside it,
which both references drop too, while a wrong rewrite (the wrong attention scale that came no
further than the original, a dropped zero point, a swapped axis) is another float program. The
output then passes, by FLOAT_PROGRAM, when it is no further from the reference than the
original, give or take the second criterion's bound (what the original's own rounding may move
it by): where the pairs a fusion drops inside it (its scores, its probabilities) saturated or
rounded coarsely, the fused output lands a little nearer or further. The test fixture's QDQ
attention at 10x its calibrated range: 0.7715 against the original's 0.7692 (self-noise 0.0070),
the references 0 apart; the seeded wrong rewrites there came no further (0.7671 to 0.7691) but
are another program (their references 1.1e-3 to 0.69 from the original's). The QDQ T5 encoders
at padded masks: 0.481 against 0.478, the references 5e-7 apart. The QDQ Llama with a KV cache
fed a cache at 10x its calibrated range: the original's logits 1.22 from its reference, the
fused attention's 1.19, the references 1.2e-6 apart; fed its own prefill's cache, 0.63 and 0.12.

The second criterion's bound is measured at the binding itself, and a dynamically quantized
model's 1-eps runs may flip no quantization step there: the Qwen3 decoder in dynamic int8 at 16
padded tokens moved 5.8e-8 under its runs (1.5e-2 at 128 tokens), while a right attention fusion,
the same program in float (references 1.1e-6 apart), flipped steps enough to move the logits by
6.6e-3 and their distance to the reference from 0.028441 to 0.028445. An unbiased move of size m
takes an output at distance d from the reference m^2 / (2d) further on average (m at right
angles to the error); a move that points away from the reference takes it up to m further. So
the bound is also twice that, m^2 / d (there 1.6e-3), for a move of at most a quarter of the
distance (UNBIASED_MOVE_SHARE), which holds a move pointing away from the reference to half of
it: there the fused output's 4.2e-6 further passes, and a move of a quarter of the distance
straight away from the reference (0.25 d further against an allowance of 0.0625 d) fails.

Beside that mean, an unbiased move has a component along the error that is as likely positive as
negative: its projection on the error, whose spread the outputs themselves give (sigma =
sqrt(sum e_i^2 m_i^2) / (||e|| ||t||) for the original's error e, the move m and the reference t:
``projection_spread``, the larger where the move sits on the larger errors). The allowance
holds PROJECTION_SIGMAS of it too. The Qwen2 decoder with a KV cache in dynamic int8 at ort (9,216
values of a key cache, 16 padded tokens): a right fusion, the same program in float (references
2.9e-7 apart), moved the cache by 1.70e-4 and took it 3.69e-6 further from its reference of
0.00819, where m^2 / d is 3.54e-6 and sigma 2.4e-6: 0.8 sigma above the mean, refused without it.
A move pointing away from the reference has its projection at m, about sqrt(n / 3) sigmas for n
values (some 55 there).

``atol``/``rtol`` switch to element-wise ``|a - b| <= atol + rtol |a|``, with no floor and no
second criterion.

A NaN in b where a has NaN is a match, as is an Inf of the same sign; every other disagreement
about non-finite values (a new NaN or Inf, or one the optimized model lost) fails. Integer,
bool and string outputs must be exactly equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphopt.numerics.paths import EPSILON, lowest

__all__ = [
    "FLOAT_PROGRAM",
    "FLOAT_REFERENCE",
    "NOISE_CEILING",
    "NOISE_FACTOR",
    "PROJECTION_SIGMAS",
    "REFERENCE_CEILING",
    "REFERENCE_NOISE_FACTOR",
    "Criterion",
    "by_reference",
    "OutputComparison",
    "compare_output",
    "judge_by_reference",
    "projection_spread",
    "rejudge",
    "relative_l2",
    "second_chance",
    "unbiased_move",
]

_TINY = float(np.finfo(np.float64).tiny)
_TINY_FLOAT32 = np.float32(np.finfo(np.float32).tiny)
# The absolute floor, in machine epsilons of the output's precision at the output's scale.
FLOOR_EPSILONS = 4
# The second criterion: relative L2 <= min(NOISE_FACTOR x the original's self-noise, NOISE_CEILING).
NOISE_FACTOR = 3.0
NOISE_CEILING = 3e-2
# The third criterion: the float reference judges only where the original approximates it
# (reference.py): at most this far from it in relative L2.
REFERENCE_CEILING = 0.1
# ... or further, where its own rounding accounts for the distance: at most this many times its
# self-noise (a saturating original is far from the reference and barely moved by its rounding).
REFERENCE_NOISE_FACTOR = 15.0
FIXED, OWN_ROUNDING, FLOAT_REFERENCE, ALLCLOSE = "fixed tolerance", "own rounding", "float reference", "allclose"
# The float program's slack beside the second criterion's bound: a move of the output by at most this share of its
# distance to the reference is judged as an unbiased one (module docstring), its projection on the original's error
# allowed this many times its spread.
UNBIASED_MOVE_SHARE = 0.25
PROJECTION_SIGMAS = 3.0
# The third criterion where the distance alone does not pass an output (the original is no
# approximation of its reference, or the output lands further from it) but the optimized model is
# the original's program in float.
FLOAT_PROGRAM = "float program"


@dataclass
class OutputComparison:
    """One output's figures. ``passed`` is None when it was not judged (``reason`` says why)."""

    name: str
    max_abs: float
    max_rel: float
    rel_l2: float
    cosine: float
    passed: bool | None
    reason: str | None = None
    p99_abs: float = 0.0
    precision: str | None = None
    limits: dict[str, float] | None = None
    # The criterion a float output passed by (FIXED, OWN_ROUNDING, ALLCLOSE); and, when the
    # second criterion was tried, the original's self-noise (None: not measured) and the bound.
    criterion: str | None = None
    self_noise: float | None = None
    bound: float | None = None
    # When the third criterion was tried: the relative L2 distance to the float reference
    # (reference.py) of the original and of the optimized output, and the bound on the latter.
    reference_original: float | None = None
    reference_optimized: float | None = None
    reference_bound: float | None = None
    # Where the distance to the reference alone did not pass the output: the relative L2 distance
    # between the optimized model's own float reference and the original's (None: not measured).
    reference_program: float | None = None


@dataclass(frozen=True)
class Criterion:
    """The default whole-tensor criterion, or element-wise allclose when ``atol``/``rtol`` are set."""

    rel_l2: float = 1e-4
    cosine: float = 0.9999
    atol: float | None = None
    rtol: float | None = None

    @classmethod
    def make(cls, atol: float | None, rtol: float | None) -> Criterion:
        if atol is None and rtol is None:
            return cls()
        # The one left out takes numpy's default, the value people know from np.allclose.
        return cls(atol=1e-8 if atol is None else atol, rtol=1e-5 if rtol is None else rtol)

    @property
    def elementwise(self) -> bool:
        return self.atol is not None

    def as_dict(self) -> dict[str, object]:
        exact = "integer, bool and string outputs: exact equality"
        if self.elementwise:
            return {"kind": "allclose", "atol": self.atol, "rtol": self.rtol, "exact": exact}
        return {
            "kind": "rel_l2_cosine",
            "own_rounding": f"failing those: rel_l2 <= min({NOISE_FACTOR:g} x self-noise, {NOISE_CEILING:g}), "
            "self-noise the RMS over the original's runs with float inputs and weights moved by 1 eps of its "
            "compute precision",
            "rel_l2_max": self.rel_l2,
            "cosine_min": self.cosine,
            "by_precision": "rel_l2 <= max(rel_l2_max, eps/2), cosine >= min(cosine_min, 1 - that**2), eps of the "
            "lowest float precision on the output's path",
            "abs_floor": f"or every |a - b| <= {FLOOR_EPSILONS} eps x max(1, max |a|)",
            "exact": exact,
        }

    def limits(self, precision: str, scale: float) -> dict[str, float]:
        """The whole-tensor limits for an output of ``precision`` whose largest magnitude is ``scale``."""
        eps = EPSILON[precision]
        rel_l2 = max(self.rel_l2, eps / 2)
        return {
            "rel_l2_max": rel_l2,
            "cosine_min": min(self.cosine, 1.0 - rel_l2 * rel_l2),
            "abs_floor": FLOOR_EPSILONS * eps * max(1.0, scale),
        }


def compare_output(
    name: str,
    a: np.ndarray | list[np.ndarray],
    b: np.ndarray | list[np.ndarray],
    criterion: Criterion,
    precision: str | None = None,
) -> OutputComparison:
    """Judge b (optimized) against a (original); ``precision`` is the lowest on the output's path.

    A sequence output (a list of tensors) must hold as many tensors of the same shapes; their
    values are then judged as one tensor, the sequence's elements end to end.
    """
    if isinstance(a, list) or isinstance(b, list):
        if not (isinstance(a, list) and isinstance(b, list)):
            return _failed(name, "a sequence in one model, a tensor in the other")
        if len(a) != len(b):
            return _failed(name, f"a sequence of {len(b)} tensors, not {len(a)}")
        for index, (x, y) in enumerate(zip(a, b)):
            if x.shape != y.shape:
                return _failed(name, f"sequence element {index} has shape {y.shape}, not {x.shape}")
        if not a:
            return OutputComparison(name, 0.0, 0.0, 0.0, 1.0, True)
        return compare_output(name, _end_to_end(a), _end_to_end(b), criterion, precision)
    if a.dtype != b.dtype:
        return _failed(name, f"dtype {a.dtype} != {b.dtype}")
    if a.shape != b.shape:
        return _failed(name, f"shape {a.shape} != {b.shape}")
    if a.dtype.kind in "OUS":
        equal = bool(np.array_equal(a, b))
        return OutputComparison(
            name,
            0.0 if equal else math.nan,
            0.0 if equal else math.nan,
            0.0,
            1.0,
            equal,
            None if equal else f"strings differ at {int(np.sum(a != b))} positions",
        )
    if a.dtype.kind in "biu":
        x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        result = _metrics(name, x, y)
        differ = int(np.count_nonzero(x != y))
        result.passed = differ == 0
        result.reason = None if differ == 0 else f"values differ at {differ} of {x.size} positions"
        return result
    direct = None if criterion.elementwise else _in_float32(a, b)
    fast = None if direct is None else _metrics_in_float32(name, *direct)
    if direct is not None and fast is not None:
        (x, y), result, reason = direct, fast, None
    else:
        x, y = _as_float64(a), _as_float64(b)
        reason = _nonfinite_reason(x, y)
        finite = np.isfinite(x) & np.isfinite(y)
        x, y = x[finite], y[finite]
        result = _metrics(name, x, y)
    result.precision = lowest([precision, _precision_of(a.dtype)])
    if reason is None:
        reason = _judge(result, x, y, criterion)
    result.passed = reason is None
    result.reason = reason
    if result.passed:
        result.criterion = ALLCLOSE if criterion.elementwise else FIXED
    return result


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    """The relative L2 distance of b from a over the positions where both are finite (as _metrics has it,
    without the figures it does not need: the second and third criteria take dozens on large outputs)."""
    direct = _relative_l2_in_float32(a, b)
    if direct is not None:
        return direct
    x, y = _as_float64(a), _as_float64(b)
    finite = np.isfinite(x) & np.isfinite(y)
    scaled = _scaled(x[finite], y[finite])
    if scaled is None:
        return 0.0
    xs, ys = scaled
    return _rel_l2(xs, ys, math.sqrt(_dot(xs, xs)))


_DIRECT = (np.dtype(np.float32), np.dtype(np.float16))


def _in_float32(*arrays: np.ndarray) -> list[np.ndarray] | None:
    """The arrays raveled as float32 where all are float32, or all float16, of one shape (None: not so).

    relative_l2, projection_spread and compare_output take their differences in float32 then, each element's exact
    to 6e-8 of itself, and sum their squares in float64 (_dot), where no float32 square, nor a product of two,
    can overflow: no float64 copies of the outputs, no scaling, no mask. On a 20M-element float32 output
    relative_l2 took 0.09 s against 1.4 s through float64, and the check of a QDQ decoder's retry calls it 42
    times. A sum that comes
    out not finite is a NaN or an Inf in an array (or a difference beyond float32), which the float64 path,
    which leaves those positions out, then handles."""
    first = arrays[0]
    if first.dtype not in _DIRECT or any(x.dtype != first.dtype or x.shape != first.shape for x in arrays):
        return None
    return [x.astype(np.float32, copy=False).ravel() for x in arrays]


def _relative_l2_in_float32(a: np.ndarray, b: np.ndarray) -> float | None:
    """relative_l2 where _in_float32 takes both, every element is finite and ``a`` is not all zero; else None."""
    direct = _in_float32(a, b)
    if direct is None:
        return None
    x, y = direct
    with np.errstate(over="ignore", invalid="ignore"):
        difference = x - y
    moved, norm = _dot(difference, difference), _dot(x, x)
    if not (math.isfinite(moved) and math.isfinite(norm)) or norm == 0.0:
        return None
    return math.sqrt(moved / norm)


def second_chance(result: OutputComparison) -> bool:
    """Whether ``result`` failed the fixed whole-tensor limits on its figures alone (not on a
    shape, a type or a NaN), which the original's own rounding may yet explain."""
    return result.passed is False and result.limits is not None


def rejudge(result: OutputComparison, noise: float | None, draws: int) -> None:
    """Judge a :func:`second_chance` output against the original's self-noise (None: not measured
    in ``draws`` usable draws)."""
    result.self_noise = noise
    if noise is None:
        result.reason = f"{result.reason}; the original's own rounding not measured ({draws} usable draws)"
        return
    result.bound = min(NOISE_FACTOR * noise, NOISE_CEILING)
    if result.rel_l2 <= result.bound:
        result.passed, result.reason, result.criterion = True, None, OWN_ROUNDING
        return
    capped = " (the ceiling)" if result.bound == NOISE_CEILING else ""
    result.reason = (
        f"{result.reason}; and beyond the original's own rounding: rel L2 {result.rel_l2:.3g}"
        f" > {NOISE_FACTOR:g} x self-noise {noise:.3g} = {result.bound:.2g}{capped}"
    )


def by_reference(original: float, optimized: float, reruns: list[float], noise: float | None) -> bool:
    """Whether the float reference alone passes an output: the original, ``original`` (relative
    L2) from it, approximates it (within REFERENCE_CEILING, or within REFERENCE_NOISE_FACTOR x its
    self-noise ``noise``), and the optimized output, ``optimized`` from it, is no further than the
    original or one of its ``reruns`` with its rounding moved."""
    return _approximates(original, noise) and optimized <= max([original, *reruns])


def _approximates(original: float, noise: float | None) -> bool:
    return original <= REFERENCE_CEILING or (noise is not None and original <= REFERENCE_NOISE_FACTOR * noise)


def judge_by_reference(
    result: OutputComparison,
    original: float,
    optimized: float,
    reruns: list[float],
    program: OutputComparison | None = None,
    spread: float = 0.0,
) -> None:
    """Judge an output that failed the first two criteria by its distance to the float reference:
    ``optimized``, the optimized output's relative L2 distance to it, must be no larger than the
    largest of ``original`` (the original's) and ``reruns`` (the original's runs with its
    rounding moved, noise.py), where the original approximates the reference (by_reference).
    Failing that, ``program`` (None: not measured), the optimized model's own float reference
    compared with the original's under the fixed float32 limits, must pass, and then the same
    bound holds give or take the second criterion's, or an unbiased move's (``spread``: the spread of the move's
    projection on the original's error, projection_spread)."""
    result.reference_original, result.reference_optimized = original, optimized
    noise = result.self_noise
    result.reference_bound = max([original, *reruns])
    if by_reference(original, optimized, reruns, noise):
        result.passed, result.reason, result.criterion = True, None, FLOAT_REFERENCE
        return
    if not _approximates(original, noise):
        explained = f" and > {REFERENCE_NOISE_FACTOR:g} x self-noise {noise:.3g}" if noise is not None else ""
        why = (
            "the original is no approximation of its float reference"
            f" (rel L2 {original:.3g} > {REFERENCE_CEILING:g}{explained})"
        )
    else:
        why = (
            f"further from the float reference than the original: rel L2 {optimized:.3g} > {result.reference_bound:.3g}"
        )
    if program is None:
        result.reason = f"{result.reason}; and {why}"
        return
    result.reference_program = program.rel_l2
    if not program.passed:
        result.reason = (
            f"{result.reason}; and {why}, and the optimized model is another program in float32"
            f" (rel L2 {program.rel_l2:.3g} between their float references)"
        )
        return
    # How far the original's own rounding may move it: the second criterion's bound, or what an unbiased move of the
    # output's own size adds to its distance, where that move is small beside the distance (module docstring).
    result.reference_bound += max(result.bound or 0.0, unbiased_move(result.rel_l2, original, spread))
    if optimized <= result.reference_bound:
        result.passed, result.reason, result.criterion = True, None, FLOAT_PROGRAM
        return
    result.reason = (
        f"{result.reason}; and the same program in float32, but further from the float reference than the"
        f" original give or take its rounding: rel L2 {optimized:.3g} > {result.reference_bound:.3g}"
    )


def unbiased_move(moved: float, distance: float, spread: float = 0.0) -> float:
    """How much further from the reference a move of relative size ``moved`` takes an output ``distance`` from it
    when the move is unbiased (at right angles to the error, it adds ``moved**2 / (2 distance)``; twice that is
    allowed, and PROJECTION_SIGMAS x ``spread``, the spread of its projection on the error), for a move of at most
    UNBIASED_MOVE_SHARE of the distance; 0 for a larger one."""
    if distance <= 0 or moved > UNBIASED_MOVE_SHARE * distance:
        return 0.0
    return moved * moved / distance + PROJECTION_SIGMAS * spread


def projection_spread(truth: np.ndarray, before: np.ndarray, after: np.ndarray) -> float:
    """The spread, relative to ``truth``'s norm, of the projection of the move ``after - before`` on the error
    ``before - truth`` were each element's move as likely up as down: sqrt(sum e_i^2 d_i^2) / (||e|| ||t||), over
    the positions where all three are finite (0 where the error or the reference is nought)."""
    direct = _projection_spread_in_float32(truth, before, after)
    if direct is not None:
        return direct
    t, a, b = (_as_float64(x).ravel() for x in (truth, before, after))
    if not (t.shape == a.shape == b.shape):
        return 0.0
    finite = np.isfinite(t) & np.isfinite(a) & np.isfinite(b)
    t, a, b = t[finite], a[finite], b[finite]
    scale = max(float(np.abs(t).max(initial=0.0)), float(np.abs(a).max(initial=0.0)), _TINY)
    t, a, b = t / scale, a / scale, b / scale  # float64 squares cannot overflow
    error, move = a - t, b - a
    norms = math.sqrt(_dot(error, error)) * math.sqrt(_dot(t, t))
    if norms == 0.0:
        return 0.0
    weighted = error * move
    return math.sqrt(_dot(weighted, weighted)) / norms


def _projection_spread_in_float32(truth: np.ndarray, before: np.ndarray, after: np.ndarray) -> float | None:
    """projection_spread where _in_float32 takes the three and every element is finite; else None."""
    direct = _in_float32(truth, before, after)
    if direct is None:
        return None
    t, a, b = direct
    with np.errstate(over="ignore", invalid="ignore"):
        error, move = a - t, b - a
    products = error.astype(np.float64) * move
    weighted, errors, reference = _dot(products, products), _dot(error, error), _dot(t, t)
    if not all(math.isfinite(v) for v in (weighted, errors, reference)):
        return None
    norms = math.sqrt(errors) * math.sqrt(reference)
    return 0.0 if norms == 0.0 else math.sqrt(weighted) / norms


def _end_to_end(sequence: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(item) for item in sequence])


def _precision_of(dtype: np.dtype) -> str | None:
    name = {"c": f"float{dtype.itemsize * 4}"}.get(dtype.kind, dtype.name)
    return name if name in EPSILON else None


def _failed(name: str, reason: str) -> OutputComparison:
    return OutputComparison(name, math.nan, math.nan, math.nan, math.nan, False, reason, math.nan)


def _as_float64(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind == "c":
        # Complex outputs are compared as (real, imag) pairs.
        return np.stack([array.real, array.imag], axis=-1).astype(np.float64).ravel()
    return array.astype(np.float64).ravel()


def _nonfinite_reason(x: np.ndarray, y: np.ndarray) -> str | None:
    nan_x, nan_y = np.isnan(x), np.isnan(y)
    inf_x, inf_y = np.isinf(x), np.isinf(y)
    checks = (
        ("new NaN", nan_y & ~nan_x),
        ("new Inf", inf_y & ~inf_x),
        ("NaN in the original is not NaN in the optimized model", nan_x & ~nan_y),
        ("Inf in the original is not the same Inf in the optimized model", inf_x & (x != y)),
    )
    for label, where in checks:
        count = int(np.count_nonzero(where))
        if count:
            first = int(np.flatnonzero(where)[0])
            return f"{label} at {count} of {x.size} positions (first at flat index {first})"
    return None


def _metrics(name: str, x: np.ndarray, y: np.ndarray) -> OutputComparison:
    if x.size == 0:
        return OutputComparison(name, 0.0, 0.0, 0.0, 1.0, True)
    diff = np.abs(x - y)
    max_abs = float(diff.max())
    p99_abs = float(np.percentile(diff, 99))
    with np.errstate(over="ignore"):
        max_rel = float((diff / np.maximum(np.abs(x), _TINY)).max())
    scaled = _scaled(x, y)
    if scaled is None:
        return OutputComparison(name, max_abs, max_rel, 0.0, 1.0, True, p99_abs=p99_abs)
    xs, ys = scaled
    norm_x, norm_y = math.sqrt(_dot(xs, xs)), math.sqrt(_dot(ys, ys))
    rel_l2 = _rel_l2(xs, ys, norm_x)
    denominator = norm_x * norm_y
    cosine = 0.0 if denominator == 0.0 else min(1.0, max(-1.0, _dot(xs, ys) / denominator))
    return OutputComparison(name, max_abs, max_rel, rel_l2, cosine, True, p99_abs=p99_abs)


def _metrics_in_float32(name: str, x: np.ndarray, y: np.ndarray) -> OutputComparison | None:
    """_metrics of two float32 arrays (_in_float32), in float32 with float64 sums, where every element is finite
    and neither is all zero; else None. A 20M-element output took 2.9 s through float64 copies. ``max_abs``, which the
    absolute floor judges, is taken in float64 among the elements whose float32 difference is within rounding of
    the largest, so that it is the general path's figure exactly. ``max_rel`` where ``|x|`` is below float32's
    smallest normal number (0 included) divides by that number, not by float64's: a reported figure, never judged."""
    if x.size == 0:
        return None
    norm_x, norm_y = _dot(x, x), _dot(y, y)
    if not (math.isfinite(norm_x) and math.isfinite(norm_y)) or norm_x == 0.0 or norm_y == 0.0:
        return None
    with np.errstate(over="ignore"):
        diff = np.abs(x - y)
        largest = diff.max()
        max_rel = float((diff / np.maximum(np.abs(x), _TINY_FLOAT32)).max())
    if not math.isfinite(largest):
        return None  # a difference beyond float32
    near = np.flatnonzero(diff >= largest * np.float32(1 - 2**-22))
    max_abs = float(np.abs(x[near].astype(np.float64) - y[near]).max())
    rel_l2 = math.sqrt(_dot(diff, diff) / norm_x)
    cosine = _dot(x, y) / math.sqrt(norm_x * norm_y)
    p99_abs = float(np.percentile(diff, 99))
    return OutputComparison(name, max_abs, max_rel, rel_l2, min(1.0, max(-1.0, cosine)), True, p99_abs=p99_abs)


def _scaled(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """x and y divided by the largest magnitude in either (None: empty or all zero), so that squares cannot
    overflow."""
    if x.size == 0:
        return None
    scale = max(float(np.abs(x).max()), float(np.abs(y).max()))
    return None if scale == 0.0 else (x / scale, y / scale)


def _rel_l2(xs: np.ndarray, ys: np.ndarray, norm_x: float) -> float:
    return math.sqrt(_dot(xs - ys, xs - ys)) / max(norm_x, _TINY)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """The sum of the products, accumulated in float64 (float32 arrays are summed without a float64 copy)."""
    # einsum, not BLAS: on a loaded machine BLAS threads spin for longer than the sum takes.
    return float(np.einsum("i,i->", a, b, dtype=np.float64))


def _judge(result: OutputComparison, x: np.ndarray, y: np.ndarray, criterion: Criterion) -> str | None:
    """Why the figures fail the criterion, or None."""
    if criterion.elementwise:
        assert criterion.atol is not None and criterion.rtol is not None
        bad = np.abs(x - y) > criterion.atol + criterion.rtol * np.abs(x)
        count = int(np.count_nonzero(bad))
        if count:
            return (
                f"{count} of {x.size} elements exceed atol {criterion.atol:g} + rtol {criterion.rtol:g}"
                f" (max abs {result.max_abs:.3g})"
            )
        return None
    scale = float(np.abs(x).max()) if x.size else 0.0
    limits = criterion.limits(result.precision or "float32", scale)
    result.limits = limits
    problems = []
    if not result.rel_l2 <= limits["rel_l2_max"]:
        problems.append(f"rel L2 {result.rel_l2:.3g} > {limits['rel_l2_max']:.2g}")
    if not result.cosine >= limits["cosine_min"]:
        problems.append(f"cosine {result.cosine:.6f} < {limits['cosine_min']:.6g}")
    if not problems or result.max_abs <= limits["abs_floor"]:
        return None
    problems.append(f"max abs {result.max_abs:.3g} > floor {limits['abs_floor']:.2g}")
    return "; ".join(problems)
