"""Arithmetic family: chains of element-wise ops by constants combine into one op.

``(x * a) * b -> x * (a*b)``, ``(x + a) + b -> x + (a+b)``, ``(x - a) + b -> x + (b-a)``,
``(x + a) - b -> x + (a-b)``, ``(x / a) / b -> x / (a*b)``, ``(x * a) / b -> x * (a/b)``,
``(x / a) * b -> x * (b/a)``. The constants combine in float64 and are stored in x's type;
the combined constant broadcasts to the same shape as the pair did, so the output shape
never changes. Only float tensors: integer division does not associate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphopt.ir import Value
from graphopt.ir.rewrite import Builder
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule
from graphopt.passes.fuse.patterns import const, op, var
from graphopt.passes.fuse.rules._helpers import float_array, is_float, new_const

FAMILY = "arith"

Combine = Callable[[np.ndarray, np.ndarray], np.ndarray]
# (outer op, inner op) -> (the op of the result, how the constants combine: f(a, b))
_CHAINS: dict[tuple[str, str], tuple[str, Combine]] = {
    ("Mul", "Mul"): ("Mul", lambda a, b: a * b),
    ("Add", "Add"): ("Add", lambda a, b: a + b),
    ("Add", "Sub"): ("Add", lambda a, b: b - a),
    ("Sub", "Add"): ("Add", lambda a, b: a - b),
    ("Sub", "Sub"): ("Sub", lambda a, b: a + b),
    ("Div", "Div"): ("Div", lambda a, b: a * b),
    ("Div", "Mul"): ("Mul", lambda a, b: a / b),
    ("Mul", "Div"): ("Mul", lambda a, b: b / a),
}


def _check(m: Match, site: Site) -> str | None:
    x, a, b = m.value("x"), m.value("a"), m.value("b")
    if not (is_float(x) and site.dtype(a) == site.dtype(x) and site.dtype(b) == site.dtype(x)):
        return "not float constants of x's type"
    if float_array(a) is None or float_array(b) is None:
        return "a constant is too large to read"
    rank = site.rank(x)
    if rank is None or max(site.rank(a) or 0, site.rank(b) or 0) > rank:
        return "the constants could widen x's rank"
    return None


def _rewrite(combine: Combine, result_op: str) -> Callable[[Builder, Match, Site], Value]:
    def rewrite(b: Builder, m: Match, site: Site) -> Value:
        a, c = float_array(m.value("a")), float_array(m.value("b"))
        assert a is not None and c is not None
        with np.errstate(divide="ignore", invalid="ignore"):
            merged = combine(a, c)
        return b.op(result_op, m.value("x"), new_const(b, merged, m.value("x"), "merged"))

    return rewrite


for (_outer, _inner), (_result, _combine) in _CHAINS.items():
    add_rule(
        Rule(
            f"{_inner.lower()}-{_outer.lower()}-constants",
            FAMILY,
            getattr(op, _outer)(
                getattr(op, _inner)(var("x"), const(name="a"), name="inner", commute=_inner in ("Add", "Mul")),
                const(name="b"),
                commute=_outer in ("Add", "Mul"),
            ),
            _rewrite(_combine, _result),
            _check,
            label=f"{_inner}+{_outer} by constants",
            doc=f"{_outer}({_inner}(x, a), b) -> {_result}(x, combined constant)",
        )
    )


def _row(m: Match) -> int | None:
    fill = m.node("fill").attr("value")
    array = fill.numpy() if fill is not None else np.zeros(1, np.float32)
    return int(array.ravel()[0]) if array.size == 1 and array.dtype.kind in "iu" else None


def _check_gathered_row(m: Match, site: Site) -> str | None:
    table = Site.array(m.value("table"))
    row = _row(m)
    if table is None or row is None or not 0 <= row < table.shape[0]:
        return "the table or the filled index is not a readable constant"
    if m.node("g").attr("axis", 0) != 0:
        return "the Gather is not over rows"
    e, g = site.shape(m.value("e")), site.shape(m.node("g").outputs[0])
    if e is None or g is None or e != g or None in e:
        return "the Add's operands do not provably have one shape"
    return None


def _rewrite_gathered_row(b: Builder, m: Match, site: Site) -> Value:
    table, row = Site.array(m.value("table")), _row(m)
    assert table is not None and row is not None
    return b.op("Add", m.value("e"), b.constant(np.ascontiguousarray(table[row]), "row"))


add_rule(
    Rule(
        "add-constant-row",
        FAMILY,
        op.Add(var("e"), op.Gather(const(name="table"), op.ConstantOfShape(var("shape"), name="fill"), name="g")),
        _rewrite_gathered_row,
        _check_gathered_row,
        label="Add of a constant row",
        doc="Add(e, Gather(T, ConstantOfShape(s, k))) -> Add(e, T[k]) when e has the gathered shape (BERT token types)",
    )
)
