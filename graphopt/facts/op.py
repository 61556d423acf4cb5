"""What a shape rule sees of one node, and the dim arithmetic the rules share.

A rule gets an :class:`Op`: the node, its input types, the values of constant inputs and
the *symbolic values* of small integer tensors (from the :class:`~graphopt.facts.Facts`
service that made the Op). A symbolic value is the flattened content
of a scalar or 1-D int tensor (or one of higher rank whose every dim is an int, row-major)
whose entries are dims, for example the output of
``Concat(Unsqueeze(Gather(Shape(x), 0)), [4], [64])`` is ``(batch, 4, 64)``; it is how
``Reshape`` learns ``[batch, seq, 4, 64]`` from shape plumbing. Symbolic values live in the
facts service's memo, never on the IR.

Unknown is ``None`` throughout: an unknown dim, an unknown shape, an unknown value. Dim
arithmetic on ``None`` gives ``None``, so rules do not have to test every operand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from graphopt.ir import DataType, Dim, Expr, Node, Sym, TensorType, Type, Value, dims
from graphopt.ir.constness import constant_array
from graphopt.ir.types import INTEGER_TYPES

__all__ = [
    "MAX_VALUE_LEN",
    "Op",
    "Operands",
    "Shape",
    "SymValue",
    "d_add",
    "d_div",
    "d_lower_bound",
    "d_mul",
    "d_prod",
    "d_sub",
    "broadcast",
    "merge_dims",
    "norm_axis",
    "registrar",
    "tensor",
]

Shape = tuple[Dim, ...]
SymValue = tuple[Dim, ...]

# Only small int tensors are tracked as symbolic values: shapes, indices, axes.
MAX_VALUE_LEN = 64
# Constants larger than this are not read (rules need shapes and small index lists only).
MAX_CONST_SIZE = 4096


Registered = TypeVar("Registered")


def registrar(table: dict[str, Registered]) -> Callable[..., Callable[[Registered], Registered]]:
    """A decorator factory: ``@register("Add", "Sub")`` enters a rule in ``table`` under each op type."""

    def register(*op_types: str) -> Callable[[Registered], Registered]:
        def add(fn: Registered) -> Registered:
            for op_type in op_types:
                table[op_type] = fn
            return fn

        return add

    return register


class SymSource(Protocol):
    """Where an Op finds the symbolic values of its inputs (the facts service)."""

    def sym(self, value: Value) -> SymValue | None: ...


def d_add(a: Dim, b: Dim) -> Dim:
    return None if a is None or b is None else dims.add(a, b)


def d_sub(a: Dim, b: Dim) -> Dim:
    return None if a is None or b is None else dims.sub(a, b)


def d_mul(a: Dim, b: Dim) -> Dim:
    return None if a is None or b is None else dims.mul(a, b)


def d_prod(values: Iterable[Dim]) -> Dim:
    result: Dim = 1
    for value in values:
        result = d_mul(result, value)
    return result


def d_div(a: Dim, b: Dim) -> Dim:
    """``a // b`` for dims: exact division by a monomial, floor division by a positive int."""
    if a is None or b is None:
        return None
    if isinstance(b, int):
        if b <= 0:
            return None
        return dims.floordiv(a, b)
    if a == b:
        return 1
    return _divide_by_monomial(a, b)


def _atom_dim(atom: Any) -> Dim:
    return atom if isinstance(atom, Sym) else Expr((((atom,), 1),))


def _terms(dim: int | Sym | Expr) -> list[tuple[tuple[Any, ...], int]]:
    if isinstance(dim, int):
        return [((), dim)] if dim else []
    if isinstance(dim, Sym):
        return [((dim,), 1)]
    return list(dim.terms)


def _divide_by_monomial(a: int | Sym | Expr, b: Sym | Expr) -> Dim:
    """``a / b`` when ``b`` is one term ``c*x*y`` that divides every term of ``a`` exactly."""
    (divisor, *rest) = _terms(b)
    if rest:
        return None
    atoms, coeff = divisor
    result: Dim = 0
    for monomial, term_coeff in _terms(a):
        remaining = list(monomial)
        for atom in atoms:
            if atom not in remaining:
                return None
            remaining.remove(atom)
        if term_coeff % coeff:
            return None
        term: Dim = term_coeff // coeff
        for atom in remaining:
            term = d_mul(term, _atom_dim(atom))
        result = d_add(result, term)
    return result


def d_lower_bound(dim: Dim) -> int | None:
    """A bound the dim never goes below: a dim variable is a size, so at least 0, and a
    polynomial in them with non-negative coefficients is at least its constant term."""
    if dim is None or isinstance(dim, int):
        return dim
    if isinstance(dim, Sym):
        return 0
    constant = 0
    for monomial, coeff in dim.terms:
        if not monomial:
            constant = coeff
        elif coeff < 0 or not all(isinstance(a, Sym) or _at_least_zero(a.numerator) for a in monomial):
            return None
    return constant


def _at_least_zero(dim: Dim) -> bool:
    low = d_lower_bound(dim)
    return low is not None and low >= 0


def norm_axis(axis: int, rank: int) -> int | None:
    """``axis`` in ``[0, rank)``, or None when it is out of range."""
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


def merge_dims(a: Dim, b: Dim) -> Dim:
    """Two descriptions of the same dim: the known one, or None if they disagree."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    return None


def _broadcast_dim(column: Sequence[Dim]) -> Dim:
    known = [d for d in column if d is not None and d != 1]
    static = {d for d in known if isinstance(d, int)}
    if len(static) > 1:
        return None
    if static:
        # A symbolic dim broadcast against a static k > 1 must be 1 or k; the result is k.
        return static.pop()
    if any(d is None for d in column):
        return None
    distinct = set(known)
    if not distinct:
        return 1
    # Two different symbolic dims: either could be 1 at run time, so the result is unknown.
    return distinct.pop() if len(distinct) == 1 else None


def broadcast(shapes: Sequence[Shape | None]) -> Shape | None:
    """Multidirectional (numpy) broadcasting over symbolic shapes."""
    if any(s is None for s in shapes) or not shapes:
        return None
    rank = max(len(s) for s in shapes if s is not None)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes if s is not None]
    return tuple(_broadcast_dim(column) for column in zip(*padded, strict=False))


# The Python types an attribute value may have where a rule's default has the key's type.
_KINDS: dict[type, tuple[type, ...]] = {list: (list, tuple), tuple: (list, tuple)}


@dataclass
class Op:
    """One node as its rules see it."""

    node: Node
    opset: int
    facts: SymSource

    def input(self, index: int) -> Value | None:
        return self.node.input(index)

    @property
    def n_inputs(self) -> int:
        return len(self.node.inputs)

    def type(self, index: int) -> TensorType | None:
        value = self.input(index)
        if value is None or not isinstance(value.type, TensorType):
            return None
        return value.type

    def dtype(self, index: int) -> DataType | None:
        found = self.type(index)
        return None if found is None else found.dtype

    def shape(self, index: int) -> Shape | None:
        found = self.type(index)
        return None if found is None else found.shape

    def const(self, index: int) -> np.ndarray | None:
        return constant_array(self.input(index), MAX_CONST_SIZE)

    def sym(self, index: int) -> SymValue | None:
        """The symbolic value of input ``index`` if it is a small int tensor we can follow."""
        value = self.input(index)
        return None if value is None else self.facts.sym(value)

    def ints(self, index: int) -> list[int] | None:
        """Input ``index`` as a list of plain ints, when every entry is static."""
        found = self.sym(index)
        if found is None or not all(isinstance(x, int) for x in found):
            return None
        return [int(x) for x in found if isinstance(x, int)]

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name``; with a ``default``, a value of another kind (a float
        ``blocksize``, an int ``equation``) raises TypeError: the rule gives the node up
        rather than compute dims from it."""
        value = self.node.attr(name, default)
        kinds = _KINDS.get(type(default), type(default))
        if default is not None and value is not None and not isinstance(value, kinds):
            raise TypeError(f"attribute {name!r} is a {type(value).__name__}, not a {type(default).__name__}")
        return value

    def is_int(self, index: int) -> bool:
        return self.dtype(index) in INTEGER_TYPES

    def axes(self, attr_before: int, index: int = 1) -> list[int] | None:
        """Axes given as an attribute (opsets below ``attr_before``) or as input ``index``."""
        if self.opset < attr_before:
            found = self.attr("axes")
            return None if found is None else list(found)
        if self.input(index) is None:
            return []
        return self.ints(index)


@dataclass
class Operands(Op):
    """A quantized op (QLinearMatMul, QLinearConv, QGemm, ...) seen as the float op it computes: that op's input
    ``i`` is the node's input ``at[i]`` (its scales and zero points are not operands), so the float op's rule
    gives the shape."""

    at: tuple[int, ...] = ()

    def input(self, index: int) -> Value | None:
        return self.node.input(self.at[index]) if index < len(self.at) else None

    @property
    def n_inputs(self) -> int:
        return len(self.at)


def tensor(dtype: DataType | None, shape: Shape | None) -> Type | None:
    """A tensor type, or None when even the element type is unknown."""
    return None if dtype is None else TensorType(dtype, None if shape is None else tuple(shape))
