"""Tensor dimensions: concrete ints, named variables and symbolic expressions.

A dimension is an ``int``, a :class:`Sym` (a named variable such as ``batch``), an
:class:`Expr` (a polynomial over syms with integer coefficients, where a floor division
by a constant is an atom of its own), or ``None`` when nothing is known about it.

Expressions are kept in a normal form, a map from monomials to coefficients, so that
``seq + 1 - 1`` is ``seq`` and ``2*b + b`` is ``3*b`` without a rewriting engine. Arithmetic
helpers (:func:`add`, :func:`sub`, :func:`mul`, :func:`floordiv`) return the simplest
representation: an ``int`` when the result is constant, a ``Sym`` when it is one variable.

Following the tracing seed, equal names denote one variable by default. When a model is
loaded with ``independent_dims``, each occurrence gets its own ``uid``, so two ``batch``
dims are different variables that merely print alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

__all__ = [
    "Dim",
    "Expr",
    "FloorDiv",
    "Sym",
    "add",
    "floordiv",
    "format_dim",
    "mul",
    "parse_dim",
    "sub",
]


@dataclass(frozen=True, order=True)
class Sym:
    """A named dimension variable; ``uid`` separates same-named independent variables."""

    name: str
    uid: int = 0

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class FloorDiv:
    """``numerator // divisor`` for a non-constant numerator and a positive constant divisor."""

    numerator: Expr
    divisor: int

    def __str__(self) -> str:
        return self.text

    @cached_property
    def text(self) -> str:
        return f"({self.numerator}) // {self.divisor}"


Atom = Sym | FloorDiv
Monomial = tuple[Atom, ...]


def _atom_key(atom: Atom) -> tuple[int, str, int]:
    if isinstance(atom, Sym):
        return (0, atom.name, atom.uid)
    return (1, str(atom), 0)


def _monomial_key(monomial: Monomial) -> tuple[int, list[tuple[int, str, int]]]:
    return (-len(monomial), [_atom_key(a) for a in monomial])


@dataclass(frozen=True)
class Expr:
    """A polynomial over dimension atoms: ``terms`` maps sorted atom tuples to coefficients.

    ``spelling`` remembers how the expression was written in the file it came from, so
    that loading and saving a model does not re-spell its dim names; it takes no part in
    equality.
    """

    terms: tuple[tuple[Monomial, int], ...]
    spelling: str | None = field(default=None, compare=False)

    def symbols(self) -> set[Sym]:
        found: set[Sym] = set()
        for monomial, _ in self.terms:
            for atom in monomial:
                if isinstance(atom, Sym):
                    found.add(atom)
                else:
                    found |= atom.numerator.symbols()
        return found

    def __str__(self) -> str:
        return self.spelling if self.spelling is not None else self.text

    @cached_property
    def text(self) -> str:
        """The canonical spelling (terms are stored sorted, largest monomials first)."""
        parts: list[str] = []
        for monomial, coeff in self.terms:
            body = "*".join(str(a) for a in monomial)
            if not body:
                text = str(abs(coeff))
            elif abs(coeff) == 1:
                text = body
            else:
                text = f"{abs(coeff)}*{body}"
            if not parts:
                parts.append(text if coeff > 0 else f"-{text}")
            else:
                parts.append(f"+ {text}" if coeff > 0 else f"- {text}")
        return " ".join(parts) if parts else "0"


Dim = int | Sym | Expr | None
Term = int | Sym | Expr  # a dim that is known, as arithmetic takes it
Poly = dict[Monomial, int]


def _poly(dim: int | Sym | Expr) -> Poly:
    if isinstance(dim, int):
        return {(): dim} if dim else {}
    if isinstance(dim, Sym):
        return {(dim,): 1}
    return dict(dim.terms)


def _simplest(poly: Poly) -> int | Sym | Expr:
    poly = {m: c for m, c in poly.items() if c}
    if not poly:
        return 0
    if list(poly) == [()]:
        return poly[()]
    if len(poly) == 1:
        ((monomial, coeff),) = poly.items()
        if coeff == 1 and len(monomial) == 1 and isinstance(monomial[0], Sym):
            return monomial[0]
    return Expr(tuple(sorted(poly.items(), key=lambda t: _monomial_key(t[0]))))


def add(a: int | Sym | Expr, b: int | Sym | Expr) -> int | Sym | Expr:
    result = _poly(a)
    for monomial, coeff in _poly(b).items():
        result[monomial] = result.get(monomial, 0) + coeff
    return _simplest(result)


def sub(a: int | Sym | Expr, b: int | Sym | Expr) -> int | Sym | Expr:
    return add(a, mul(-1, b))


def mul(a: int | Sym | Expr, b: int | Sym | Expr) -> int | Sym | Expr:
    result: Poly = {}
    for ma, ca in _poly(a).items():
        for mb, cb in _poly(b).items():
            monomial = tuple(sorted(ma + mb, key=_atom_key))
            result[monomial] = result.get(monomial, 0) + ca * cb
    return _simplest(result)


def floordiv(a: int | Sym | Expr, divisor: int) -> int | Sym | Expr:
    """``a // divisor``; exact when every coefficient divides, an atom otherwise."""
    if divisor <= 0:
        raise ValueError(f"floor division of a dimension by {divisor}")
    poly = _poly(a)
    if all(c % divisor == 0 for c in poly.values()):
        return _simplest({m: c // divisor for m, c in poly.items()})
    if list(poly) == [()]:
        return poly[()] // divisor
    # (n*d + r) // d == n + r // d only for a constant r; keep the rest as one atom.
    return _simplest({(FloorDiv(Expr(tuple(sorted(poly.items(), key=lambda t: _monomial_key(t[0])))), divisor),): 1})


# A small recursive-descent parser for dim_param strings such as "seq + 1" or "2*(n // 4)".
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*()]))")


def _divide_by_constant(value: Term, divisor: Term) -> Term:
    if isinstance(divisor, int) and divisor > 0:
        return floordiv(value, divisor)
    raise ValueError("division by a non-constant")


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if not match:
                raise ValueError(text)
            self.tokens.append(match.group(match.lastindex or 0))
            pos = match.end()
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("unexpected end")
        self.pos += 1
        return token

    def binary(self, operand: Callable[[], Term], operators: Mapping[str, Callable[[Term, Term], Term]]) -> Term:
        """A left-associative chain ``operand (op operand)*`` of one precedence level."""
        value = operand()
        while (token := self.peek()) is not None and token in operators:
            self.take()
            value = operators[token](value, operand())
        return value

    def sum(self) -> Term:
        return self.binary(self.product, {"+": add, "-": sub})

    def product(self) -> Term:
        return self.binary(self.factor, {"*": mul, "//": _divide_by_constant})

    def factor(self) -> Term:
        token = self.take()
        if token == "(":
            value = self.sum()
            if self.take() != ")":
                raise ValueError("unbalanced parenthesis")
            return value
        if token == "-":
            return mul(-1, self.factor())
        if token.isdigit():
            return int(token)
        if token[0].isalpha() or token[0] == "_":
            return Sym(token)
        raise ValueError(token)


@functools.lru_cache(maxsize=4096)  # a model repeats a handful of dim names on every value
def parse_dim(text: str) -> int | Sym | Expr:
    """Read a dim_param: a plain name is a :class:`Sym`; arithmetic becomes an :class:`Expr`.

    Text that is not an expression (``"batch size"``, ``"n/a"``) stays one opaque name, so
    exporters' names always survive a round trip.
    """
    try:
        parser = _Parser(text)
        value = parser.sum()
        if parser.peek() is not None:
            raise ValueError(text)
    except ValueError:
        return Sym(text)
    if isinstance(value, Sym) and value.name == text:
        return value
    if isinstance(value, Expr):
        return Expr(value.terms, spelling=text)
    # "n - n" or "(batch)": keep the author's spelling rather than folding it away.
    return Sym(text)


def format_dim(dim: Dim) -> str:
    return "?" if dim is None else str(dim)
