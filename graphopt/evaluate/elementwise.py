"""Element-wise kernels: arithmetic, comparisons, logic, unary math, Where and Cast.

numpy and onnxruntime differ in a few places this module settles the onnxruntime way:
integer Div truncates toward zero (C++ division) where numpy floors; Mod takes the
divisor's sign unless ``fmod``; Pow keeps the base's dtype and, as onnxruntime's
``std::pow`` does, computes in double when the base is an integer or the exponent's type
differs; an integer division by zero is an error, as onnxruntime reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import reduce

import numpy as np

from graphopt.evaluate.base import Call, Unsupported, kernel, numpy_dtype, same_dtype
from graphopt.ir import DataType

__all__ = ["truncating_divide"]


def _register(since: int, table: Mapping[str, np.ufunc], make: Callable[[np.ufunc], Callable[..., np.ndarray]]) -> None:
    for op, ufunc in table.items():
        kernel(op, since=since)(make(ufunc))


def _reserve_broadcast(call: Call, dtype: np.dtype, *arrays: np.ndarray) -> None:
    call.reserve(np.broadcast_shapes(*(a.shape for a in arrays)), dtype)


def _numeric(*arrays: np.ndarray) -> np.dtype:
    dtype = same_dtype(*arrays)
    if dtype == np.bool_:
        raise Unsupported("arithmetic on bool")
    return dtype


def _floating(x: np.ndarray) -> np.dtype:
    if numpy_dtype(x.dtype).kind != "f":
        raise Unsupported(f"{x.dtype} where ONNX allows only floats")
    return x.dtype


def truncating_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero, as C++ (and so onnxruntime) divides."""
    if not np.all(b):
        raise ValueError("integer division by zero")
    quotient = np.floor_divide(a, b)
    if a.dtype.kind == "i":
        inexact = np.not_equal(quotient * b, a) & ((a < 0) != (b < 0))
        quotient = quotient + inexact.astype(quotient.dtype)
    return quotient


def _binary(ufunc: np.ufunc) -> Callable[[Call, np.ndarray, np.ndarray], np.ndarray]:
    def run(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        _reserve_broadcast(call, _numeric(a, b), a, b)
        return ufunc(a, b)  # type: ignore[no-any-return]

    return run


_register(7, {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}, _binary)


@kernel("Div", since=7)
def _div(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = _numeric(a, b)
    _reserve_broadcast(call, dtype, a, b)
    if dtype.kind in "iu":
        return truncating_divide(a, b)
    return np.true_divide(a, b)


@kernel("Mod", attrs=("fmod",), since=10)
def _mod(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dtype = _numeric(a, b)
    _reserve_broadcast(call, dtype, a, b)
    fmod = bool(call.attr("fmod", 0))
    if dtype.kind == "f":
        if not fmod:
            raise ValueError("Mod of floats needs fmod=1")
        return np.fmod(a, b)
    if not np.all(b):
        raise ValueError("integer modulo by zero")
    return np.fmod(a, b) if fmod else np.mod(a, b)


@kernel("Pow", since=7)
def _pow(call: Call, base: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    dtype = _numeric(base)
    _numeric(exponent)
    _reserve_broadcast(call, dtype, base, exponent)
    if dtype == exponent.dtype and dtype.kind == "f":
        return np.power(base, exponent)
    return np.power(base.astype(np.float64), exponent.astype(np.float64)).astype(dtype)


def _variadic(ufunc: np.ufunc, *, floats_only: bool = False) -> Callable[..., np.ndarray]:
    def run(call: Call, *arrays: np.ndarray) -> np.ndarray:
        dtype = _numeric(*arrays)
        if floats_only:
            _floating(arrays[0])
        _reserve_broadcast(call, dtype, *arrays)
        return reduce(ufunc, arrays)

    return run


kernel("Min", since=8)(_variadic(np.minimum))
kernel("Max", since=8)(_variadic(np.maximum))
kernel("Sum", since=8)(_variadic(np.add, floats_only=True))


@kernel("Mean", since=8)
def _mean(call: Call, *arrays: np.ndarray) -> np.ndarray:
    total = _variadic(np.add, floats_only=True)(call, *arrays)
    return np.true_divide(total, np.asarray(len(arrays), dtype=total.dtype))


def _comparison(ufunc: np.ufunc) -> Callable[[Call, np.ndarray, np.ndarray], np.ndarray]:
    def run(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        same_dtype(a, b)
        _reserve_broadcast(call, np.dtype(np.bool_), a, b)
        return ufunc(a, b)  # type: ignore[no-any-return]

    return run


_register(
    7,
    {
        "Equal": np.equal,
        "Less": np.less,
        "Greater": np.greater,
        "LessOrEqual": np.less_equal,
        "GreaterOrEqual": np.greater_equal,
    },
    _comparison,
)


def _logical(ufunc: np.ufunc, kind: str) -> Callable[..., np.ndarray]:
    """A bool (``kind`` "b") or integer-bitwise (``kind`` "iu") op of one or two inputs."""

    def run(call: Call, *arrays: np.ndarray) -> np.ndarray:
        dtype = same_dtype(*arrays)
        if dtype.kind not in kind:
            raise Unsupported(f"{dtype} input")
        _reserve_broadcast(call, dtype, *arrays)
        return ufunc(*arrays)  # type: ignore[no-any-return]

    return run


_register(7, {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}, lambda f: _logical(f, "b"))
_register(1, {"Not": np.logical_not}, lambda f: _logical(f, "b"))
_register(
    18,
    {"BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or, "BitwiseXor": np.bitwise_xor, "BitwiseNot": np.invert},
    lambda f: _logical(f, "iu"),
)


def _unary(ufunc: np.ufunc, *, floats_only: bool) -> Callable[[Call, np.ndarray], np.ndarray]:
    def run(call: Call, x: np.ndarray) -> np.ndarray:
        dtype = _floating(x) if floats_only else _numeric(x)
        call.reserve(x.shape, dtype)
        return ufunc(x)  # type: ignore[no-any-return]

    return run


# Since 6: opset 1's versions carry the legacy ``consumed_inputs`` attribute.
_register(6, {"Neg": np.negative, "Abs": np.abs, "Sign": np.sign}, lambda f: _unary(f, floats_only=False))
_register(
    6,
    {
        "Sqrt": np.sqrt,
        "Exp": np.exp,
        "Log": np.log,
        "Reciprocal": np.reciprocal,
        "Floor": np.floor,
        "Ceil": np.ceil,
        "Round": np.rint,  # both round half to even
    },
    lambda f: _unary(f, floats_only=True),
)


@kernel("Where", since=9)
def _where(call: Call, condition: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if condition.dtype != np.bool_:
        raise ValueError(f"Where's condition is {condition.dtype}, not bool")
    dtype = same_dtype(x, y)
    _reserve_broadcast(call, dtype, condition, x, y)
    return np.where(condition, x, y)


def _cast_to(call: Call, x: np.ndarray, target: DataType) -> np.ndarray:
    numpy_dtype(x.dtype)
    try:
        dtype = numpy_dtype(target.numpy())
    except TypeError:
        raise Unsupported(f"cast to {target.name}") from None
    call.reserve(x.shape, dtype)
    return x.astype(dtype, copy=False)


# ``saturate`` only concerns float8 targets, which go to onnxruntime anyway.
@kernel("Cast", attrs=("to", "saturate"), since=6)
def _cast(call: Call, x: np.ndarray) -> np.ndarray:
    return _cast_to(call, x, DataType(call.attr("to")))


@kernel("CastLike", attrs=("saturate",), since=15)
def _cast_like(call: Call, x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return _cast_to(call, x, DataType.from_numpy(numpy_dtype(like.dtype)))
