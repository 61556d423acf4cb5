"""The original model's own rounding noise: the second criterion of the check (see compare.py).

A float16 model rounds every value to 11 bits; a quantized model rounds its activations to
256 steps, and a dynamically quantized one (DynamicQuantizeLinear) recomputes its scales from
the activations, so moving the last bit of one activation moves whole quantization steps
downstream. A correct rewrite that merely rounds differently (a fused LayerNorm, a reordered
sum) then moves such a model's outputs by more than the fixed tolerance, although no more than
the model's own rounding moves them.

This module measures that rounding. The original runs again ``DRAWS`` times, each time with
its float data moved by rounding-level amounts: every float graph input and every float
initializer of the main graph is multiplied by ``1 + eps u``, u uniform in [-1/2, 1/2] per
element, with eps the machine epsilon of the model's lowest compute precision (float16 9.8e-4,
float32 1.2e-7), and is stored back in its own type. The weights matter as much as the inputs:
a language model's inputs are integer ids, which cannot be rounded. Left alone, because an ulp
there is no rounding but another program: integer and quantized tensors (a quantized weight's
last bit is a whole step), tensors of fewer than ``SMALLEST`` elements (exponents, Clip
bounds, Resize scales, epsilons: scalars and small parameter vectors, where an ulp can change
a shape or turn Pow of a negative base into NaN), and tensors that look like masks or
sentinels (every value 0 or 1, or any value non-finite or beyond 1e30 or half its type's
largest, where ``(1 - mask) x min`` would turn an ulp into 1e31, and float16's -65504 into
-inf). Nor are tensors stored outside the file, tensors in an If, Loop or Scan body, and the
tensors past the check's memory budget: the draws then move less, which can only make the
bound tighter.

A statically quantized model (QuantizeLinear -> DequantizeLinear on its activations) rounds
each activation to its grid, and an ulp of a float rarely moves a value across a grid line: such
a model would measure no noise at all, and any rewrite that computes a quantized interior in
float (a fused attention or norm reading the dequantized inputs, as onnxruntime's own QDQ
fusions do) would fail by the model's own quantization error. So the draws also move each
activation's grid: the scale of every QuantizeLinear of a value computed at run time is
multiplied by ``1 + 2^-bits u`` (bits of its zero point's type: 8 for int8, 4 for int4), which
moves a value k steps from zero by up to k / 2^(bits+1) steps, at most half a step: each value
is rounded to a grid up to half a step away, what computing it in float instead does at most.
The DequantizeLinear reading the same scale tensor moves with it, so the grid moves, not the
gain. Weight scales stay: a weight's grid is part of the program.

Why not only a reference run with the float16 or quantized parts in float32: as a bound on how
far the optimized output may move from the original, that reference is too wide, the model's
whole quantization error (1.5e-2 on ViT in dynamic int8, issue 34), ten times what a right
rewrite moves it (1.5e-3): a wrong rewrite would pass. Rounding one value by half an ulp is
what a rewrite does to each value it touches. The reference serves the third criterion
differently (reference.py): there the optimized output must come no further from it than the
original is, which a wrong rewrite's own error does not allow.

An output's self-noise is the root mean square over the draws of the relative L2 distance
between the original's output and its perturbed run's. The root mean square, not the median:
a quantization flip is a rare event in a small tensor, and the mean of squares counts the
draws in which it happened. A draw in which the output changed shape or gained a NaN or Inf
is left out; fewer than ``FEWEST`` usable draws measure nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from graphopt.ir.types import DataType
from graphopt.numerics.compare import relative_l2
from graphopt.numerics.feeds import Feed
from graphopt.numerics.paths import EPSILON, inline_array, is_qdq

__all__ = ["DRAWS", "FEWEST", "SMALLEST", "Perturbation", "self_noise"]

DRAWS = 6
# A value moves by up to AMPLITUDE x eps of itself: half an ulp at the top of a binade, the
# largest error one rounding makes. Measured on the float16 fixtures of
# tests/test_check_precision.py against each one's own error from its float32 original: a
# full eps overstated it 3.8x (8.3e-4 against 2.2e-4), half an eps 2.0x (4.5e-4), and 1.15x
# where float16 rounding dominates (sharp attention: 3.0e-3 against 2.6e-3).
AMPLITUDE = 0.5
FEWEST = 4
SMALLEST = 16
_SENTINEL = 1e30


@dataclass
class Perturbation:
    """What the draws move: the model's perturbable float initializers, and eps; and the scales
    of its activations' quantization grids, each with its own eps (2^-bits)."""

    precision: str
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    grids: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, path: Path, precision: str, room: int) -> Perturbation:
        """The initializers of the model at ``path`` a draw moves, while their copies (this one
        and a draw's) fit in ``room`` bytes; past it, the draws move the rest no more."""
        found = cls(precision)
        model = onnx.load(str(path), load_external_data=False)
        grids = _activation_grids(model.graph)
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                continue  # reading it would double what the check holds; the rest still moves
            array = inline_array(tensor)
            if array is not None and tensor.name in grids and array.dtype.kind == "f":
                found.grids[tensor.name] = (array, 2.0 ** -grids[tensor.name])
                continue
            if array is None or not _movable(array):
                continue
            room -= 2 * array.nbytes  # this copy, and a draw's moved one
            if room < 0:
                break
            found.initializers[tensor.name] = array
        return found

    def draw(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The initializers of one draw, moved."""
        moved = {name: self.moved(array, rng) for name, array in self.initializers.items()}
        return moved | {name: _scaled(array, eps, rng) for name, (array, eps) in self.grids.items()}

    def feed(self, feed: Mapping[str, Feed], rng: np.random.Generator) -> dict[str, Feed]:
        """The inputs of one draw: the float inputs that are no mask moved, the rest as they were."""
        return {
            name: self.moved(array, rng) if isinstance(array, np.ndarray) and _movable(array, inputs=True) else array
            for name, array in feed.items()
        }

    def moved(self, array: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _scaled(array, EPSILON[self.precision], rng)


def _scaled(array: np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
    noise = 1.0 + eps * rng.uniform(-AMPLITUDE, AMPLITUDE, array.shape)
    return np.asarray(array.astype(np.float64) * noise).astype(array.dtype)  # a scale is often 0-d


def _activation_grids(graph: onnx.GraphProto) -> dict[str, int]:
    """The scale initializers of the main graph's QuantizeLinear nodes that quantize a value
    computed at run time (not a weight), with their grid's bits."""
    stored = {tensor.name: tensor for tensor in graph.initializer}
    grids: dict[str, int] = {}
    for node in graph.node:
        if not is_qdq(node, "QuantizeLinear") or len(node.input) < 2:
            continue
        if node.input[0] in stored or node.input[1] not in stored:
            continue
        zero_point = stored.get(node.input[2]) if len(node.input) > 2 else None
        grid = DataType(zero_point.data_type) if zero_point is not None else DataType.UINT8  # QuantizeLinear's default
        if grid.name.startswith(("INT", "UINT")):  # a float8 grid is not evenly spaced: left alone
            bits = grid.itemsize_bits
            grids[node.input[1]] = min(bits, grids.get(node.input[1], bits))
    return grids


def _movable(array: np.ndarray, *, inputs: bool = False) -> bool:
    if array.dtype.kind != "f" or array.dtype.itemsize < 2 or (not inputs and array.size < SMALLEST):
        return False
    sentinel = min(_SENTINEL, float(np.finfo(array.dtype).max) / 2)  # float16's -65504 masks too
    if array.size == 0 or not np.isfinite(array).all() or float(np.abs(array).max()) > sentinel:
        return False
    return not bool(np.isin(array, (0.0, 1.0)).all())


def self_noise(original: Feed, draws: list[Feed]) -> tuple[float | None, int]:
    """An output's self-noise from its perturbed runs (None: fewer than FEWEST usable), and
    how many draws were usable."""
    distances = [
        relative_l2(original, draw)
        for draw in draws
        if isinstance(original, np.ndarray)
        and isinstance(draw, np.ndarray)
        and draw.shape == original.shape
        and bool(np.array_equal(np.isfinite(original), np.isfinite(draw)))
    ]
    if len(distances) < FEWEST:
        return None, len(distances)
    return math.sqrt(sum(d * d for d in distances) / len(distances)), len(distances)
