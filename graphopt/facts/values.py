"""Symbolic values of small int tensors: the shape plumbing between Shape and Reshape.

Each rule maps an :class:`Op` to the flattened symbolic values of its outputs (``None``
where unknown). Exporters compute target shapes at run time (``Shape -> Gather ->
Unsqueeze -> Concat -> Reshape``); following those values with dims as entries is what
lets Reshape, Expand and ConstantOfShape outputs keep names such as ``batch``.

    Shape(x: [batch, seq, 256])        -> (batch, seq, 256)
    Gather(that, 1)                    -> (seq,)
    Concat(Unsqueeze(..), [4], [64])   -> (batch, seq, 4, 64)

A value of rank 2 or more is followed too, row-major, where its type gives every dim as an
int: TorchScript writes ``F.pad`` with computed pads as a Reshape to ``[-1, 2]``, a Slice that
flips the rows and a Transpose before the Pad reads them. Rules that move entries of such a
value (Slice, Transpose, Concat, broadcasting) read it as the grid its type gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from graphopt.facts.op import MAX_VALUE_LEN, Op, SymValue, d_add, d_div, d_lower_bound, d_mul, d_prod, d_sub, registrar
from graphopt.ir import DataType, Dim, Tensor
from graphopt.ir.slicing import slice_of

__all__ = ["VALUE_RULES", "ValueRule"]

ValueRule = Callable[[Op], list[SymValue | None]]
VALUE_RULES: dict[str, ValueRule] = {}

_INT_TARGETS = {DataType.INT64, DataType.INT32, DataType.INT16, DataType.INT8, DataType.UINT32, DataType.UINT64}


value_rule = registrar(VALUE_RULES)


@value_rule("Shape")
def shape_value(op: Op) -> list[SymValue | None]:
    x = op.shape(0)
    if x is None:
        return [None]
    return [x[slice(op.attr("start", 0), op.attr("end"))]]


@value_rule("Size")
def size_value(op: Op) -> list[SymValue | None]:
    x = op.shape(0)
    return [None if x is None else (d_prod(x),)]


# Ops that only move a scalar or vector's entries around without changing their order.
@value_rule("Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten")
def same_values(op: Op) -> list[SymValue | None]:
    return [op.sym(0)]


@value_rule("Cast")
def cast_value(op: Op) -> list[SymValue | None]:
    # Dims stay exact only through integer casts; a float detour (sqrt(head_dim)) ends here.
    return [op.sym(0) if DataType(op.attr("to")) in _INT_TARGETS else None]


@value_rule("Concat")
def concat_value(op: Op) -> list[SymValue | None]:
    parts = [op.sym(i) for i in range(op.n_inputs)]
    if any(p is None for p in parts):
        return [None]
    if any(_rank(op, i) not in (None, 0, 1) for i in range(op.n_inputs)):
        grids = [_grid(op, i) for i in range(op.n_inputs)]
        if any(g is None for g in grids):
            return [None]
        return [_flat(np.concatenate([g for g in grids if g is not None], axis=op.attr("axis", 0)))]
    joined = tuple(d for part in parts if part is not None for d in part)
    return [joined if len(joined) <= MAX_VALUE_LEN else None]


@value_rule("Gather")
def gather_value(op: Op) -> list[SymValue | None]:
    data, indices = op.sym(0), op.ints(1)
    if data is None or indices is None or op.attr("axis", 0) not in (0, -1) or _rank(op, 0) not in (None, 1):
        return [None]
    if not all(-len(data) <= i < len(data) for i in indices):
        return [None]
    return [tuple(data[i] for i in indices)]


@value_rule("Slice")
def slice_value(op: Op) -> list[SymValue | None]:
    if op.opset < 10:
        starts, ends, axes, steps = op.attr("starts"), op.attr("ends"), op.attr("axes"), None
    else:
        starts, ends, axes, steps = (op.ints(i) if op.input(i) is not None else None for i in range(1, 5))
        if any(op.input(i) is not None and bound is None for i, bound in zip((3, 4), (axes, steps), strict=True)):
            return [None]  # axes or steps given but unknown: not the defaults
    grid = _grid(op, 0)
    data = op.sym(0)
    if grid is None and data is not None and _rank(op, 0) in (None, 1):
        grid = _grid_of(data, [len(data)])
    if grid is None or not starts or not ends or len(starts) != len(ends):
        return [None]
    axes = list(range(len(starts))) if axes is None else axes
    steps = steps or [1] * len(starts)
    if len(axes) != len(starts) or len(steps) != len(starts):
        return [None]
    cuts = [slice(None)] * grid.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        cuts[axis] = slice_of(start, end, step, grid.shape[axis])
    return [_flat(grid[tuple(cuts)])]


@value_rule("Transpose")
def transpose_value(op: Op) -> list[SymValue | None]:
    grid = _grid(op, 0)
    if grid is None:
        return [None]
    perm = op.attr("perm")
    return [_flat(np.transpose(grid, perm))]


@value_rule("Split")
def split_value(op: Op) -> list[SymValue | None]:
    """A shape vector cut into pieces: ``Split(Shape(x), [1, 1, 1])`` -> (b,), (s,), (256,)."""
    data, count = op.sym(0), len(op.node.outputs)
    if data is None or op.attr("axis", 0) not in (0, -1) or _rank(op, 0) not in (None, 1):
        return [None] * count
    if op.opset < 13:
        sizes = op.attr("split")
    else:
        sizes = op.ints(1) if op.input(1) is not None else None
    if sizes is None:
        if len(data) % count:  # opset 18's uneven num_outputs split
            return [None] * count
        sizes = [len(data) // count] * count
    if len(sizes) != count or sum(sizes) != len(data) or any(n < 0 for n in sizes):
        return [None] * count
    bounds = [sum(sizes[:k]) for k in range(count + 1)]
    return [data[bounds[k] : bounds[k + 1]] for k in range(count)]


def _elementwise(op: Op, fn: Callable[[Dim, Dim], Dim]) -> list[SymValue | None]:
    a, b = op.sym(0), op.sym(1)
    if a is None or b is None:
        return [None]
    if _rank(op, 0) not in (None, 0, 1) or _rank(op, 1) not in (None, 0, 1):
        left, right = _grid(op, 0), _grid(op, 1)
        if left is None or right is None:
            return [None]
        return [_flat(np.frompyfunc(fn, 2, 1)(left, right))]
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        return [None]
    n = max(len(a), len(b))
    a = a * n if len(a) == 1 else a
    b = b * n if len(b) == 1 else b
    return [tuple(fn(x, y) for x, y in zip(a, b, strict=False))]


def _rank(op: Op, index: int) -> int | None:
    shape = op.shape(index)
    return None if shape is None else len(shape)


def _grid(op: Op, index: int) -> np.ndarray | None:
    """Input ``index``'s symbolic value as the grid its type gives, where every dim is an int."""
    data, shape = op.sym(index), op.shape(index)
    if data is None or shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return _grid_of(data, [d for d in shape if isinstance(d, int)])


def _grid_of(data: SymValue, dims: list[int]) -> np.ndarray | None:
    if math.prod(dims) != len(data):
        return None
    grid = np.empty(len(data), dtype=object)
    grid[:] = list(data)
    return grid.reshape(dims)


def _flat(grid: np.ndarray | Sequence[Dim]) -> SymValue:
    return tuple(np.asarray(grid, dtype=object).ravel().tolist())


@value_rule("Add")
def add_value(op: Op) -> list[SymValue | None]:
    return _elementwise(op, d_add)


@value_rule("Sub")
def sub_value(op: Op) -> list[SymValue | None]:
    return _elementwise(op, d_sub)


@value_rule("Mul")
def mul_value(op: Op) -> list[SymValue | None]:
    return _elementwise(op, d_mul)


def _int_div(a: Dim, b: Dim) -> Dim:
    # ONNX integer Div truncates; dims are non-negative, so that is floor division.
    if isinstance(a, int) and isinstance(b, int) and b:
        return int(a / b)
    return d_div(a, b)


@value_rule("Div")
def div_value(op: Op) -> list[SymValue | None]:
    if not op.is_int(0):
        return [None]
    return _elementwise(op, _int_div)


def _int_mod(fmod: bool) -> Callable[[Dim, Dim], Dim]:
    """ONNX's integer Mod: the divisor's sign (Python's %), or the dividend's with ``fmod``. A symbolic
    dividend whose every coefficient the divisor divides leaves 0 either way (Swin's pad to a multiple of
    the window, ``(7 - 56 % 7) % 7``, is where this matters)."""

    def mod(a: Dim, b: Dim) -> Dim:
        if isinstance(a, int) and isinstance(b, int) and b:
            return int(math.fmod(a, b)) if fmod else a % b
        rest = d_sub(a, d_mul(d_div(a, b), b)) if isinstance(b, int) and b > 0 else None
        return 0 if rest == 0 else None

    return mod


@value_rule("Mod")
def mod_value(op: Op) -> list[SymValue | None]:
    if not op.is_int(0):
        return [None]
    return _elementwise(op, _int_mod(bool(op.attr("fmod", 0))))


def _static(fn: Callable[[int, int], int]) -> Callable[[Dim, Dim], Dim]:
    def apply(a: Dim, b: Dim) -> Dim:
        if isinstance(a, int) and isinstance(b, int):
            return fn(a, b)
        return a if a == b else None

    return apply


@value_rule("Max")
def max_value(op: Op) -> list[SymValue | None]:
    return _elementwise(op, _static(max)) if op.n_inputs == 2 else [None]


@value_rule("Min")
def min_value(op: Op) -> list[SymValue | None]:
    return _elementwise(op, _static(min)) if op.n_inputs == 2 else [None]


@value_rule("Equal")
def equal_value(op: Op) -> list[SymValue | None]:
    def equal(a: Dim, b: Dim) -> Dim:
        if a is not None and a == b:
            return 1
        if isinstance(a, int) and isinstance(b, int):
            return 0
        # A size never equals a number below its bound: Equal(sizes, -1), TorchScript's test
        # of which expand() sizes to keep, is all false on the dims.
        low_a, low_b = d_lower_bound(a), d_lower_bound(b)
        if (isinstance(b, int) and low_a is not None and b < low_a) or (
            isinstance(a, int) and low_b is not None and a < low_b
        ):
            return 0
        return None

    return _elementwise(op, equal)


@value_rule("Where")
def where_value(op: Op) -> list[SymValue | None]:
    cond, x, y = op.sym(0), op.sym(1), op.sym(2)
    if cond is None or x is None or y is None or len({len(cond), len(x), len(y)} - {1}) > 1:
        return [None]
    if any(_rank(op, i) not in (None, 0, 1) for i in range(3)) and len({op.shape(i) for i in range(3)}) > 1:
        return [None]
    n = max(len(cond), len(x), len(y))
    cond, x, y = (v * n if len(v) == 1 else v for v in (cond, x, y))
    picked = [a if c == 1 else b if c == 0 else None for c, a, b in zip(cond, x, y, strict=False)]
    return [tuple(picked)]


@value_rule("ConstantOfShape")
def constant_of_shape_value(op: Op) -> list[SymValue | None]:
    shape, fill = op.ints(0), op.attr("value")
    fill_value = fill.numpy().ravel() if isinstance(fill, Tensor) else None
    if shape is None or len(shape) > 1 or fill_value is None or fill_value.dtype.kind not in "iub":
        return [None]
    count = shape[0] if shape else 1
    return [(int(fill_value[0]),) * count if count <= MAX_VALUE_LEN else None]


@value_rule("Range")
def range_value(op: Op) -> list[SymValue | None]:
    bounds = [op.ints(i) for i in range(3)]
    if any(b is None or len(b) != 1 for b in bounds):
        return [None]
    (start,), (limit,), (delta,) = (b for b in bounds if b is not None)
    values = range(start, limit, delta) if delta else range(0)
    return [tuple(values) if len(values) <= MAX_VALUE_LEN else None]


# -- conditions: what If nodes test about shapes (rank checks, size checks) ------------------


def _greater(a: Dim, b: Dim) -> bool | None:
    """Whether ``a > b`` holds for every binding of the dims (True), for none (False), or None."""
    if isinstance(a, int) and isinstance(b, int):
        return a > b
    if a is not None and a == b:
        return False
    low_a, low_b = d_lower_bound(a), d_lower_bound(b)
    if isinstance(b, int) and low_a is not None and low_a > b:
        return True  # a size above a number below its bound: Greater(n + 1, 0)
    if isinstance(a, int) and low_b is not None and a <= low_b:
        return False
    return None


def _negated(found: bool | None) -> bool | None:
    return None if found is None else not found


def _bit(dim: Dim) -> bool | None:
    return bool(dim) if isinstance(dim, int) else None


def _truth(fn: Callable[[Dim, Dim], bool | None]) -> ValueRule:
    """A comparison or logic op's rule: 1 or 0 where ``fn`` decides, unknown where it cannot."""

    def rule(op: Op) -> list[SymValue | None]:
        def entry(a: Dim, b: Dim) -> Dim:
            found = fn(a, b)
            return None if found is None else int(found)

        return _elementwise(op, entry)

    return rule


def _logic(fn: Callable[[bool, bool], bool]) -> Callable[[Dim, Dim], bool | None]:
    def apply(a: Dim, b: Dim) -> bool | None:
        x, y = _bit(a), _bit(b)
        return None if x is None or y is None else fn(x, y)

    return apply


# Greater(n, 256) -> 1 where n is 512; Less(a, b) is Greater(b, a); a >= b is not (b > a).
value_rule("Greater")(_truth(_greater))
value_rule("Less")(_truth(lambda a, b: _greater(b, a)))
value_rule("GreaterOrEqual")(_truth(lambda a, b: _negated(_greater(b, a))))
value_rule("LessOrEqual")(_truth(lambda a, b: _negated(_greater(a, b))))
value_rule("And")(_truth(_logic(lambda x, y: x and y)))
value_rule("Or")(_truth(_logic(lambda x, y: x or y)))
value_rule("Xor")(_truth(_logic(lambda x, y: x != y)))


@value_rule("Not")
def not_value(op: Op) -> list[SymValue | None]:
    # Not(Equal(rank, 2)) -> 0 where the rank is 2: TorchScript's "if input.dim() != 2".
    found = op.sym(0)
    return [None if found is None else tuple(None if _bit(d) is None else int(not _bit(d)) for d in found)]
