"""What the numpy kernels share: the error types, the call a kernel receives, the registry.

A kernel is a plain function of the node's input arrays (``None`` for an omitted optional
input) that returns the output arrays, with the ONNX output dtypes. It raises
:class:`Unsupported` for a case it does not model (an exotic dtype, an attribute it does
not know, a legacy form of the op); the evaluator then runs the node in onnxruntime. It
raises :class:`EvaluationError` (through :meth:`Call.reserve`) when an output would not
fit the byte budget, and ``ValueError`` for inputs the op rejects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.ir import AttrKind, DataType, Node, Tensor
from graphopt.ir.types import INTEGER_TYPES

__all__ = [
    "Call",
    "EvaluationError",
    "KERNELS",
    "Kernel",
    "Unsupported",
    "describe",
    "kernel",
    "kernel_for",
    "numpy_dtype",
    "same_dtype",
    "tensor_array",
]


class EvaluationError(Exception):
    """A region cannot be evaluated: an op with no evaluator, the byte budget, a failed kernel."""


class Unsupported(Exception):
    """A numpy kernel does not model this case; onnxruntime should run the node."""


def describe(node: Node) -> str:
    """How messages name a node: its op, and its name or else its first output's name."""
    label = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    if node.name:
        return f"{label} node {node.name!r}"
    if node.outputs and node.outputs[0].name:
        return f"{label} node producing {node.outputs[0].name!r}"
    return f"{label} node"


@dataclass
class Call:
    """One application of a kernel: the node, its domain's opset, and the byte budget."""

    node: Node
    opset: int
    # Raises EvaluationError when another ``nbytes`` would exceed what is left of the budget.
    charge: Callable[[int], None]

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attr(name, default)

    def reserve(self, shape: Sequence[int], dtype: np.dtype) -> tuple[int, ...]:
        """Check, before allocating it, that an array of this shape fits the budget."""
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in output shape {shape}")
        self.charge(math.prod(shape) * np.dtype(dtype).itemsize)
        return shape

    @property
    def output_count(self) -> int:
        return len(self.node.outputs)


Kernel = Callable[..., "np.ndarray | Sequence[np.ndarray]"]


@dataclass(frozen=True)
class _Entry:
    function: Kernel
    since: int
    attrs: frozenset[str]


KERNELS: dict[str, _Entry] = {}


def kernel(*ops: str, attrs: Collection[str] = (), since: int = 1) -> Callable[[Kernel], Kernel]:
    """Register a kernel for standard-domain ``ops`` from opset ``since`` on. A node with an
    attribute outside ``attrs`` (a legacy or newer form) is left to onnxruntime."""

    def register(function: Kernel) -> Kernel:
        for op in ops:
            KERNELS[op] = _Entry(function, since, frozenset(attrs))
        return function

    return register


def kernel_for(node: Node, opset: int) -> Kernel | None:
    """The numpy kernel that models this node at this opset, if there is one."""
    if not node.in_standard_domain:
        return None
    entry = KERNELS.get(node.op_type)
    if entry is None or opset < entry.since or not entry.attrs.issuperset(node.attributes):
        return None
    if any(a.kind in (AttrKind.GRAPH, AttrKind.GRAPHS) for a in node.attributes.values()):
        return None
    return entry.function


def same_dtype(*arrays: np.ndarray) -> np.dtype:
    """The one dtype the arrays share; ONNX ops of type T accept nothing else."""
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1:
        raise Unsupported(f"mixed input dtypes {sorted(str(d) for d in dtypes)}")
    dtype = dtypes.pop()
    numpy_dtype(dtype)
    return dtype


# The element types numpy computes with exactly as ONNX does.
_PLAIN = frozenset(
    t.numpy() for t in (*INTEGER_TYPES, DataType.BOOL, DataType.FLOAT16, DataType.FLOAT, DataType.DOUBLE)
)


def numpy_dtype(dtype: np.dtype) -> np.dtype:
    """``dtype`` if it is one of those (not a string, complex or raw exotic float)."""
    if dtype not in _PLAIN:
        raise Unsupported(f"dtype {dtype}")
    return dtype


def tensor_array(tensor: Tensor) -> np.ndarray:
    array = np.asarray(tensor.numpy())
    numpy_dtype(array.dtype)
    return array
