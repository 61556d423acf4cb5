"""Kernels for tensor plumbing: constants, shapes, reshapes, indexing and generators.

Axes, starts and ends follow the ONNX rules rather than numpy's: a negative axis counts
from the end and must still name an axis; Slice clamps its bounds (differently for
negative steps) instead of wrapping them, except that an end of INT_MAX with a negative
step runs through the first element, as in onnxruntime (the standard would stop short);
Reshape's 0 copies the input's dimension unless ``allowzero``. Every kernel that can make
an output larger than its inputs reserves it against the byte budget before allocating.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from graphopt.evaluate.base import Call, Unsupported, kernel, numpy_dtype, same_dtype, tensor_array
from graphopt.ir.slicing import slice_of

__all__ = ["axes_from", "axes_of", "normalize_axis"]


def normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def axes_of(axes: Sequence[int], rank: int) -> list[int]:
    """Axes made non-negative, each named once."""
    found = [normalize_axis(int(a), rank) for a in axes]
    if len(set(found)) != len(found):
        raise ValueError(f"axes {list(axes)} repeat an axis")
    return found


def _ints(array: np.ndarray | None) -> list[int] | None:
    """The values of a 1-D (or scalar) integer input, as Python ints."""
    if array is None:
        return None
    if array.dtype.kind not in "iu":
        raise ValueError(f"expected an integer tensor, got {array.dtype}")
    return [int(v) for v in array.reshape(-1)]


_CONSTANT_ATTRS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


@kernel("Constant", attrs=("value", *_CONSTANT_ATTRS))
def _constant(call: Call) -> np.ndarray:
    if len(call.node.attributes) != 1:
        raise ValueError("a Constant needs exactly one value attribute")
    ((name, attr),) = call.node.attributes.items()
    if name == "value":
        return tensor_array(attr.value)
    return np.array(attr.value, dtype=_CONSTANT_ATTRS[name])


@kernel("Identity")
def _identity(call: Call, x: np.ndarray) -> np.ndarray:
    return x


@kernel("Dropout", attrs=("ratio", "seed"), since=7)
def _dropout(
    call: Call, x: np.ndarray, ratio: np.ndarray | None = None, training_mode: np.ndarray | None = None
) -> list[np.ndarray]:
    if training_mode is not None and bool(training_mode.reshape(-1)[0]):
        raise ValueError("training-mode Dropout is random")
    outputs = [x]
    if call.output_count > 1:
        outputs.append(np.ones(call.reserve(x.shape, np.dtype(np.bool_)), dtype=np.bool_))
    return outputs


@kernel("Shape", attrs=("start", "end"))
def _shape(call: Call, x: np.ndarray) -> np.ndarray:
    rank = x.ndim
    start, end = (int(call.attr(name, default)) for name, default in (("start", 0), ("end", rank)))
    start, end = (min(max(b + rank if b < 0 else b, 0), rank) for b in (start, end))
    return np.array(x.shape[start:end], dtype=np.int64)


@kernel("Size")
def _size(call: Call, x: np.ndarray) -> np.ndarray:
    return np.array(x.size, dtype=np.int64)


@kernel("Reshape", attrs=("allowzero",), since=5)
def _reshape(call: Call, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    target = _ints(shape) or []
    copy_zeros = not call.attr("allowzero", 0)
    dims = []
    for index, dim in enumerate(target):
        if dim == 0 and copy_zeros:
            if index >= x.ndim:
                raise ValueError(f"shape {target} copies dimension {index} of a rank-{x.ndim} input")
            dim = x.shape[index]
        dims.append(dim)
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise ValueError(f"invalid target shape {target}")
    return x.reshape(dims)


@kernel("Flatten", attrs=("axis",))
def _flatten(call: Call, x: np.ndarray) -> np.ndarray:
    axis = int(call.attr("axis", 1))
    if not -x.ndim <= axis <= x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    axis += x.ndim if axis < 0 else 0
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def axes_from(call: Call, array: np.ndarray | None, input_since: int) -> list[int] | None:
    """An op's axes: an attribute before opset ``input_since``, an input from then on."""
    if call.opset < input_since:
        if array is not None:
            raise ValueError(f"axes are an attribute before opset {input_since}")
        axes = call.attr("axes")
        return None if axes is None else list(axes)
    if "axes" in call.node.attributes:
        raise ValueError(f"axes are an input from opset {input_since} on")
    return _ints(array)


@kernel("Squeeze", attrs=("axes",))
def _squeeze(call: Call, x: np.ndarray, axes_input: np.ndarray | None = None) -> np.ndarray:
    axes = axes_from(call, axes_input, 13)
    if axes is None:
        found = [i for i, d in enumerate(x.shape) if d == 1]
    else:
        found = axes_of(axes, x.ndim)
        if any(x.shape[a] != 1 for a in found):
            raise ValueError(f"cannot squeeze axes {axes} of shape {list(x.shape)}")
    return x.reshape([d for i, d in enumerate(x.shape) if i not in found])


@kernel("Unsqueeze", attrs=("axes",))
def _unsqueeze(call: Call, x: np.ndarray, axes_input: np.ndarray | None = None) -> np.ndarray:
    axes = axes_from(call, axes_input, 13)
    if axes is None:
        raise ValueError("Unsqueeze needs axes")
    found = set(axes_of(axes, x.ndim + len(axes)))
    dims = iter(x.shape)
    return x.reshape([1 if i in found else next(dims) for i in range(x.ndim + len(axes))])


@kernel("Transpose", attrs=("perm",))
def _transpose(call: Call, x: np.ndarray) -> np.ndarray:
    perm = call.attr("perm")
    return np.transpose(x, None if perm is None else [int(p) for p in perm])


@kernel("Concat", attrs=("axis",), since=4)
def _concat(call: Call, *arrays: np.ndarray) -> np.ndarray:
    dtype = same_dtype(*arrays)
    first = arrays[0]
    axis = normalize_axis(int(call.attr("axis")), first.ndim)
    shape = list(first.shape)
    shape[axis] = sum(a.shape[axis] if a.ndim == first.ndim else 0 for a in arrays)
    call.reserve(shape, dtype)
    return np.concatenate(arrays, axis=axis)


@kernel("Split", attrs=("axis", "split", "num_outputs"), since=2)
def _split(call: Call, x: np.ndarray, split_input: np.ndarray | None = None) -> list[np.ndarray]:
    axis = normalize_axis(int(call.attr("axis", 0)), x.ndim)
    dim = x.shape[axis]
    sizes = _ints(split_input) if call.opset >= 13 else call.attr("split")
    count = call.output_count
    if sizes is None:
        num_outputs = call.attr("num_outputs")
        if num_outputs is not None:
            count = int(num_outputs)
            chunk = -(-dim // count)
            sizes = [chunk] * (count - 1) + [dim - chunk * (count - 1)]
        elif dim % count:
            raise ValueError(f"dimension {dim} does not split into {count} equal parts")
        else:
            sizes = [dim // count] * count
    sizes = [int(s) for s in sizes]
    if len(sizes) != call.output_count or sum(sizes) != dim or min(sizes) < 0:
        raise ValueError(f"split sizes {sizes} do not cover dimension {dim} in {call.output_count} parts")
    return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


def _indices(indices: np.ndarray, dim: int) -> np.ndarray:
    """Indices made non-negative, checked against ``dim``."""
    if indices.dtype not in (np.int32, np.int64):
        raise ValueError(f"indices of dtype {indices.dtype}")
    if indices.size and (indices.min() < -dim or indices.max() >= dim):
        raise ValueError(f"an index is out of range for a dimension of {dim}")
    return np.where(indices < 0, indices + dim, indices)


@kernel("Gather", attrs=("axis",))
def _gather(call: Call, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = normalize_axis(int(call.attr("axis", 0)), x.ndim)
    call.reserve((*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :]), x.dtype)
    return np.take(x, _indices(indices, x.shape[axis]), axis=axis)


@kernel("GatherElements", attrs=("axis",), since=11)
def _gather_elements(call: Call, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = normalize_axis(int(call.attr("axis", 0)), x.ndim)
    if indices.ndim != x.ndim or any(i > d for i, d in zip(indices.shape, x.shape)):
        raise ValueError(f"indices of shape {list(indices.shape)} for data of shape {list(x.shape)}")
    call.reserve(indices.shape, x.dtype)
    grid: list[np.ndarray] = list(np.indices(indices.shape, sparse=True))
    grid[axis] = _indices(indices, x.shape[axis])
    return x[tuple(grid)]


@kernel("Slice", attrs=("starts", "ends", "axes"))
def _slice(
    call: Call,
    x: np.ndarray,
    starts_input: np.ndarray | None = None,
    ends_input: np.ndarray | None = None,
    axes_input: np.ndarray | None = None,
    steps_input: np.ndarray | None = None,
) -> np.ndarray:
    if call.opset < 10:
        starts, ends, axes = (call.attr(name) for name in ("starts", "ends", "axes"))
        steps = None
    else:
        starts, ends, axes, steps = (_ints(a) for a in (starts_input, ends_input, axes_input, steps_input))
    if starts is None or ends is None or len(starts) != len(ends):
        raise ValueError("Slice needs as many starts as ends")
    axes = axes_of(range(len(starts)) if axes is None else axes, x.ndim)
    steps = [1] * len(starts) if steps is None else steps
    if len(axes) != len(starts) or len(steps) != len(starts):
        raise ValueError("Slice's starts, ends, axes and steps differ in length")
    index = [slice(None)] * x.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[axis] = slice_of(int(start), int(end), int(step), x.shape[axis])
    return x[tuple(index)]


@kernel("Range", since=11)
def _range(call: Call, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    dtype = same_dtype(start, limit, delta)
    if dtype.kind not in "if" or dtype == np.float16:
        raise Unsupported(f"Range over {dtype}")
    first, step = start.reshape(()), delta.reshape(())
    if step == 0:
        raise ValueError("Range's delta is 0")
    # onnxruntime's count: the span in the element type, divided in double.
    span = np.subtract(limit.reshape(()), first, dtype=dtype)
    count = max(math.ceil(float(span) / float(step)), 0)
    call.reserve((count,), dtype)
    if dtype.kind == "i":
        return first + np.arange(count, dtype=dtype) * step
    # ... and its values: a running sum in the element type, which numpy's cumsum also is.
    steps = np.full(count, step, dtype=dtype)
    if count:
        steps[0] = first
    return np.cumsum(steps, dtype=dtype)


@kernel("ConstantOfShape", attrs=("value",), since=9)
def _constant_of_shape(call: Call, shape: np.ndarray) -> np.ndarray:
    tensor = call.attr("value")
    value = np.zeros(1, np.float32) if tensor is None else tensor_array(tensor).reshape(-1)
    if value.size != 1:
        raise ValueError("ConstantOfShape's value has more than one element")
    dims = call.reserve(_ints(shape) or [], value.dtype)
    return np.full(dims, value[0], dtype=value.dtype)


@kernel("Expand", since=8)
def _expand(call: Call, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    target = _ints(shape) or []
    if any(d < 0 for d in target):
        raise ValueError(f"negative dimension in {target}")
    dims = call.reserve(np.broadcast_shapes(x.shape, tuple(target)), x.dtype)
    return np.array(np.broadcast_to(x, dims))


@kernel("Tile", since=6)
def _tile(call: Call, x: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    counts = _ints(repeats) or []
    if len(counts) != x.ndim or any(c < 0 for c in counts):
        raise ValueError(f"repeats {counts} for a rank-{x.ndim} input")
    call.reserve([d * c for d, c in zip(x.shape, counts)], x.dtype)
    return np.tile(x, counts)


@kernel("NonZero", since=9)
def _non_zero(call: Call, x: np.ndarray) -> np.ndarray:
    numpy_dtype(x.dtype)
    if x.ndim == 0:
        raise Unsupported("NonZero of a scalar")
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)
