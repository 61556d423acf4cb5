"""Arithmetic family: chains of element-wise ops by constants combine into one op.

``(x * a) * b -> x * (a*b)``, ``(x + a) + b -> x + (a+b)``, ``(x - a) + b -> x + (b-a)``,
``(x + a) - b -> x + (a-b)``, ``(x / a) / b -> x / (a*b)``, ``(x * a) / b -> x * (a/b)``,
``(x / a) * b -> x * (b/a)``. The constants combine in float64 and are stored in x's type;
the combined constant broadcasts to the same shape as the pair did, so the output shape
never changes. Only float tensors: integer division does not associate.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.rules._helpers import float_array, is_float, new_const
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, Site
from graphopt.passes.rewrite.patterns import Pattern, const, op, var

FAMILY = "arith"

Combine = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _constants(m: Match, site: Site) -> tuple[np.ndarray, np.ndarray] | Refuse:
    """The two constants (float64), or why the pair does not combine."""
    x, a, b = m.value("x"), m.value("a"), m.value("b")
    if not (is_float(x) and site.dtype(a) == site.dtype(x) and site.dtype(b) == site.dtype(x)):
        return Refuse("not float constants of x's type")
    first, second = float_array(a), float_array(b)
    if first is None or second is None:
        return Refuse("a constant is too large to read")
    rank = site.rank(x)
    if rank is None or max(site.rank(a) or 0, site.rank(b) or 0) > rank:
        return Refuse("the constants could widen x's rank")
    return first, second


def _combined(result_op: str, combine: Combine, b: Builder, m: Match, plan: tuple[np.ndarray, np.ndarray]) -> Value:
    with np.errstate(divide="ignore", invalid="ignore"):
        merged = combine(*plan)
    return b.op(result_op, m.value("x"), new_const(b, merged, m.value("x"), "merged"))


def _pair(outer: str, inner: str) -> Pattern:
    """``outer(inner(x, a), b)`` for constants ``a`` and ``b``."""
    commutes = ("Add", "Mul")
    pair = getattr(op, inner)(var("x"), const(name="a"), name="inner", commute=inner in commutes)
    return getattr(op, outer)(pair, const(name="b"), commute=outer in commutes)  # type: ignore[no-any-return]


def _row(m: Match) -> int | None:
    fill = m.node("fill").attr("value")
    array = fill.numpy() if fill is not None else np.zeros(1, np.float32)
    return int(array.ravel()[0]) if array.size == 1 and array.dtype.kind in "iu" else None


def _gathered_row(m: Match, site: Site) -> np.ndarray | Refuse:
    """The constant row the Gather reads, or why not."""
    table = Site.array(m.value("table"))
    row = _row(m)
    if table is None or row is None or not 0 <= row < table.shape[0]:
        return Refuse("the table or the filled index is not a readable constant")
    if m.node("g").attr("axis", 0) != 0:
        return Refuse("the Gather is not over rows")
    e, g = site.shape(m.value("e")), site.shape(m.node("g").outputs[0])
    if e is None or g is None or e != g or None in e:
        return Refuse("the Add's operands do not provably have one shape")
    found: np.ndarray = table[row]
    return found


# (outer op, inner op, the op of the result, how the inner then the outer constant combine)
_PAIRS: tuple[tuple[str, str, str, Combine], ...] = (
    ("Mul", "Mul", "Mul", lambda a, b: a * b),
    ("Add", "Add", "Add", lambda a, b: a + b),
    ("Add", "Sub", "Add", lambda a, b: b - a),
    ("Sub", "Add", "Add", lambda a, b: a - b),
    ("Sub", "Sub", "Sub", lambda a, b: a + b),
    ("Div", "Div", "Div", lambda a, b: a * b),
    ("Div", "Mul", "Mul", lambda a, b: a / b),
    ("Mul", "Div", "Mul", lambda a, b: b / a),
)

RULES: tuple[Rule[Any], ...] = (
    *(
        Rule(
            name=f"{inner.lower()}-{outer.lower()}-constants",
            family=FAMILY,
            pattern=_pair(outer, inner),
            plan=_constants,
            build=partial(_combined, result, combine),
            label=f"{inner}+{outer} by constants",
            doc=f"{outer}({inner}(x, a), b) -> {result}(x, combined constant)",
        )
        for outer, inner, result, combine in _PAIRS
    ),
    Rule(
        name="add-constant-row",
        family=FAMILY,
        pattern=op.Add(
            var("e"), op.Gather(const(name="table"), op.ConstantOfShape(var("shape"), name="fill"), name="g")
        ),
        plan=_gathered_row,
        build=lambda b, m, row: b.op("Add", m.value("e"), b.constant(np.ascontiguousarray(row), "row")),
        label="Add of a constant row",
        doc="Add(e, Gather(T, ConstantOfShape(s, k))) -> Add(e, T[k]) when e has the gathered shape (BERT token types)",
    ),
)
