"""Small helpers the rule families share: numerics of constants and broadcast shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from graphopt.ir import DataType, Node, Value
from graphopt.ir.rewrite import Builder
from graphopt.ir.types import FLOAT_ARRAYS, FLOAT_TYPES
from graphopt.passes.rewrite.engine import Match, Refuse, Site

__all__ = [
    "shared_reader",
    "NOT_FLOAT",
    "attrs_of",
    "axes_of",
    "float_array",
    "float_x",
    "is_float",
    "new_const",
    "scalar_factor",
    "static_shape",
    "trailing_axes",
]


def is_float(value: Value | None) -> bool:
    """Whether ``value`` is a tensor of float16, bfloat16, float32 or float64."""
    return Site.dtype(value) in FLOAT_TYPES


NOT_FLOAT = "x is not a float tensor of known type"


def float_x(m: Match, site: Site) -> Refuse | None:
    """A check: the match's ``x`` is a float tensor of known type."""
    return None if is_float(m.value("x")) else Refuse(NOT_FLOAT)


def scalar_factor(value: Value | None, divides: bool) -> float | None:
    """The factor a constant scalar applies when a Mul (or, with ``divides``, a Div) takes it."""
    found = float_array(value)
    if found is None or found.size != 1:
        return None
    factor = float(found.ravel()[0])
    return (1.0 / factor if factor else None) if divides else factor


def float_array(value: Value | None) -> np.ndarray | None:
    """A float constant's values as float64 (None: not a float constant)."""
    array = stored_float_array(value)
    return None if array is None else array.astype(np.float64)


def stored_float_array(value: Value | None) -> np.ndarray | None:
    """A float constant's values in its own type, read-only (None: not a float constant): a large
    weight a rule only scales, read without a float64 copy of it."""
    array = Site.array(value)
    return array if array is not None and array.dtype in FLOAT_ARRAYS else None


def scaled_into(array: np.ndarray, factor: np.ndarray, like: Value | None) -> np.ndarray:
    """``array * factor`` (broadcast) computed in float64 and rounded once into ``like``'s element
    type, as ``float_array``'s product would be, without a float64 copy of the whole product."""
    dtype = Site.dtype(like)
    out = np.empty(np.broadcast_shapes(array.shape, factor.shape), dtype.numpy() if dtype is not None else np.float64)
    np.multiply(array, factor, out=out, dtype=np.float64, casting="unsafe")
    return out


def static_shape(value: Value | None) -> tuple[int, ...] | None:
    shape = Site.shape(value)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def axes_of(node: Node, site: Site, attr_before: int = 18) -> list[int] | None:
    """A reduction's axes: the attribute below opset ``attr_before``, else input 1."""
    if site.opset < attr_before or len(node.inputs) < 2 or node.inputs[1] is None:
        found = node.attr("axes")
        return None if found is None else [int(a) for a in found]
    array = Site.array(node.inputs[1])
    return None if array is None else [int(a) for a in array.ravel()]


def trailing_axes(axes: list[int] | None, rank: int | None) -> int | None:
    """The first axis when ``axes`` are exactly the last k axes of a rank-``rank`` tensor."""
    if axes is None or rank is None or not axes:
        return None
    normal = sorted(a + rank if a < 0 else a for a in axes)
    first = rank - len(normal)
    return first if normal == list(range(first, rank)) else None


def new_const(b: Builder, array: np.ndarray, like: Value | None, name: str) -> Value:
    """A constant with ``array``'s values and shape (a 0-d array stays 0-d) in ``like``'s element type."""
    dtype = Site.dtype(like)
    target: Any = dtype.numpy() if dtype is not None else array.dtype
    # no copy of an array already in that type: the constant takes it over (Tensor.from_array), and every
    # caller passes an array it computed and leaves alone
    return b.constant(array.astype(target, order="C", copy=False), name)


def named_after(source: Value | None, role: str) -> str:
    """The name of a constant a rule makes from ``source``'s: ``conv1.weight_fused``, so that
    the source name people trace in Netron survives the rewrite; ``role`` alone for a nameless source."""
    return f"{source.name}_{role}" if source is not None and source.name else role


def cast_source(value: Value, to: DataType, source: DataType | None = None) -> Value | None:
    """The value that ``value`` is a Cast to ``to`` of (of type ``source`` where given), if it is one."""
    cast = value.producer
    if cast is None or cast.op_type != "Cast" or Site.int_attr(cast, "to", 0) != to:
        return None
    found = cast.inputs[0]
    return found if found is not None and (source is None or Site.dtype(found) == source) else None


def attrs_of(node: Node, **overrides: Any) -> dict[str, Any]:
    """``node``'s attributes as Builder keywords, with ``overrides`` (None drops one)."""
    found: dict[str, Any] = dict(node.attributes)
    found.update(overrides)
    return {k: v for k, v in found.items() if v is not None}


def shared_reader(value: Value, name: str, make: Callable[[], Value]) -> Value:
    """The output of ``value``'s reader whose node name starts with ``name``, or else ``make()``'s:
    a node a rule adds once per model (a mask cast, a flattened cache) and every layer shares."""
    for use in value.uses():
        if use.node.name.startswith(name):
            return use.node.outputs[0]
    return make()
