"""Symbolic values of small int tensors: the shape plumbing between Shape and Reshape.

Each rule maps an :class:`Op` to the flattened symbolic values of its outputs (``None``
where unknown). Exporters compute target shapes at run time (``Shape -> Gather ->
Unsqueeze -> Concat -> Reshape``); following those values with dims as entries is what
lets Reshape, Expand and ConstantOfShape outputs keep names such as ``batch``.

    Shape(x: [batch, seq, 256])        -> (batch, seq, 256)
    Gather(that, 1)                    -> (seq,)
    Concat(Unsqueeze(..), [4], [64])   -> (batch, seq, 4, 64)
"""

from __future__ import annotations

from collections.abc import Callable

from graphopt.facts.op import MAX_VALUE_LEN, Op, SymValue, d_add, d_div, d_lower_bound, d_mul, d_prod, d_sub, registrar
from graphopt.ir import DataType, Dim, Tensor

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
    joined = tuple(d for part in parts if part is not None for d in part)
    return [joined if len(joined) <= MAX_VALUE_LEN else None]


@value_rule("Gather")
def gather_value(op: Op) -> list[SymValue | None]:
    data, indices = op.sym(0), op.ints(1)
    if data is None or indices is None or op.attr("axis", 0) not in (0, -1):
        return [None]
    if not all(-len(data) <= i < len(data) for i in indices):
        return [None]
    return [tuple(data[i] for i in indices)]


@value_rule("Slice")
def slice_value(op: Op) -> list[SymValue | None]:
    data = op.sym(0)
    if op.opset < 10:
        starts, ends, steps = op.attr("starts"), op.attr("ends"), None
    else:
        starts, ends = op.ints(1), op.ints(2)
        steps = op.ints(4) if op.input(4) is not None else None
    if data is None or not starts or not ends or len(starts) != 1 or len(ends) != 1:
        return [None]
    step = steps[0] if steps else 1
    return [data[slice(starts[0], ends[0], step)]]


@value_rule("Split")
def split_value(op: Op) -> list[SymValue | None]:
    """A shape vector cut into pieces: ``Split(Shape(x), [1, 1, 1])`` -> (b,), (s,), (256,)."""
    data, count = op.sym(0), len(op.node.outputs)
    if data is None or op.attr("axis", 0) not in (0, -1):
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
    if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
        return [None]
    n = max(len(a), len(b))
    a = a * n if len(a) == 1 else a
    b = b * n if len(b) == 1 else b
    return [tuple(fn(x, y) for x, y in zip(a, b, strict=False))]


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
