"""Kernels that combine elements: MatMul, the Reduce family and DequantizeLinear.

Results keep the input's dtype as ONNX requires (numpy would widen small integer sums to
int64 and average integers into floats): float16 accumulates in float32 and rounds once,
an integer ReduceMean divides its sum truncating toward zero as onnxruntime does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from graphopt.evaluate.base import Call, Unsupported, kernel, numpy_dtype, same_dtype
from graphopt.evaluate.elementwise import truncating_divide
from graphopt.evaluate.shaping import axes_from, axes_of, normalize_axis

__all__: list[str] = []


def _accumulator(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype == np.float16 else dtype


@kernel("MatMul")
def _matmul(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = same_dtype(a, b)
    if dtype == np.bool_ or a.ndim == 0 or b.ndim == 0:
        raise Unsupported("MatMul of bools or scalars")
    left = a.shape if a.ndim > 1 else (1, *a.shape)
    right = b.shape if b.ndim > 1 else (*b.shape, 1)
    if left[-1] != right[-2]:
        raise ValueError(f"MatMul of shapes {list(a.shape)} and {list(b.shape)}")
    rows = left[-2:-1] if a.ndim > 1 else ()
    columns = right[-1:] if b.ndim > 1 else ()
    call.reserve((*np.broadcast_shapes(left[:-2], right[:-2]), *rows, *columns), dtype)
    work = _accumulator(dtype)
    return np.matmul(a.astype(work, copy=False), b.astype(work, copy=False)).astype(dtype, copy=False)


def _sum(x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
    work = _accumulator(x.dtype)
    return np.sum(x, axis=axes, keepdims=keepdims, dtype=work).astype(x.dtype, copy=False)


def _prod(x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
    work = _accumulator(x.dtype)
    return np.prod(x, axis=axes, keepdims=keepdims, dtype=work).astype(x.dtype, copy=False)


def _mean(x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        raise Unsupported("the mean of no elements")
    if x.dtype.kind in "iu":
        return truncating_divide(_sum(x, axes, keepdims), np.asarray(count, dtype=x.dtype))
    work = _accumulator(x.dtype)
    return np.mean(x, axis=axes, keepdims=keepdims, dtype=work).astype(x.dtype, copy=False)


def _extreme(function: Callable[..., np.ndarray]) -> Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray]:
    def run(x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
        if any(x.shape[a] == 0 for a in axes):
            raise Unsupported("the extreme of no elements")
        return function(x, axis=axes, keepdims=keepdims)

    return run


def _reduce(
    reducer: Callable[[np.ndarray, tuple[int, ...], bool], np.ndarray], axes_input_since: int, *, bools: bool = False
) -> Callable[[Call, np.ndarray, np.ndarray | None], np.ndarray]:
    def run(call: Call, x: np.ndarray, axes_input: np.ndarray | None = None) -> np.ndarray:
        if numpy_dtype(x.dtype) == np.bool_ and not bools:
            raise Unsupported("an arithmetic reduction of bools")
        axes: Sequence[int] | None = axes_from(call, axes_input, axes_input_since)
        if not axes:
            if call.attr("noop_with_empty_axes", 0):
                return x
            axes = range(x.ndim)
        return reducer(x, tuple(axes_of(axes, x.ndim)), bool(call.attr("keepdims", 1)))

    return run


_REDUCE_ATTRS = ("axes", "keepdims", "noop_with_empty_axes")
kernel("ReduceSum", attrs=_REDUCE_ATTRS)(_reduce(_sum, 13))
kernel("ReduceMean", attrs=_REDUCE_ATTRS)(_reduce(_mean, 18))
kernel("ReduceProd", attrs=_REDUCE_ATTRS)(_reduce(_prod, 18))
kernel("ReduceMax", attrs=_REDUCE_ATTRS)(_reduce(_extreme(np.max), 18, bools=True))
kernel("ReduceMin", attrs=_REDUCE_ATTRS)(_reduce(_extreme(np.min), 18, bools=True))


@kernel("DequantizeLinear", attrs=("axis", "block_size"), since=10)
def _dequantize_linear(
    call: Call, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None
) -> np.ndarray:
    if call.attr("block_size", 0):
        raise Unsupported("blocked dequantization")
    if numpy_dtype(x.dtype).kind not in "iu" or numpy_dtype(scale.dtype).kind != "f":
        raise Unsupported(f"dequantizing {x.dtype} with a {scale.dtype} scale")
    if zero_point is not None and zero_point.dtype != x.dtype:
        raise ValueError(f"zero point of dtype {zero_point.dtype} for {x.dtype} data")
    if scale.size == 1 and scale.ndim <= 1:
        shape: tuple[int, ...] = ()
    elif scale.ndim == 1:
        axis = normalize_axis(int(call.attr("axis", 1)), x.ndim)
        if scale.shape[0] != x.shape[axis]:
            raise ValueError(f"{scale.shape[0]} scales for axis {axis} of shape {list(x.shape)}")
        shape = tuple(-1 if i == axis else 1 for i in range(x.ndim))
    else:
        raise Unsupported("blocked dequantization")
    if zero_point is not None and zero_point.size != scale.size:
        raise ValueError("the zero point and the scale differ in size")
    work = _accumulator(scale.dtype)
    call.reserve(x.shape, work)
    # One array, updated in place: float32 holds every 8- and 16-bit difference exactly,
    # and an int32 input has no zero point.
    result = x.astype(work)
    if zero_point is not None:
        result -= zero_point.astype(work).reshape(shape)
    result *= scale.astype(work).reshape(shape)
    return result.astype(scale.dtype, copy=False)
