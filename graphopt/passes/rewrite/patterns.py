"""Patterns over the IR, written like the math they match, and the matcher.

A pattern is a tree of entries read from the root backwards. ``op.Mul(x, const(0.5))``
matches a Mul node whose inputs are the value bound to ``x`` and a compile-time constant
equal to 0.5 (commutative ops try both input orders). Leaves are variables (:func:`var`),
which bind any value, and constants (:func:`const`), which bind a compile-time constant;
an entry may test attributes (keyword arguments, a value or a predicate) and the node
itself (``where=``). Sub-patterns on inputs are nested entries: ``op.Gemm(a, op.Transpose(w))``
says "input 1 is produced by a Transpose".

Patterns are DAGs: a variable's name, or the same entry object used twice, binds one
value or node, so LayerNorm's ``x - mean(x)`` and GELU's ``h * (1 + erf(h / sqrt 2))``
name their shared leaf once. :func:`either` gives alternative spellings (``Pow(d, 2)`` or
``Mul(d, d)``); :func:`optional` matches an input that may be omitted; :func:`chain` walks back
through a run of ops of a set (Unsqueezes and Casts in any order and number), bound as one.

The matcher is a generator of bindings, so alternatives and commuted orders backtrack
without state on the pattern objects; patterns are immutable and shared between rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphopt.errors import GraphoptError
from graphopt.ir import DataType, Node, TensorType, Value
from graphopt.ir.constness import constant_array, is_constant
from graphopt.ir.node import STANDARD_DOMAINS
from graphopt.ir.types import is_number_array

__all__ = [
    "ANY_DOMAIN",
    "COMMUTATIVE",
    "Bindings",
    "Chain",
    "Const",
    "Either",
    "OpPattern",
    "Optional",
    "Pattern",
    "Polynomial",
    "Var",
    "chain",
    "const",
    "either",
    "entries",
    "match",
    "op",
    "optional",
    "polynomial",
    "root_ops",
    "scalar",
    "var",
]

# ``op.X(..., domain=ANY_DOMAIN)`` matches X in any domain (the rule tells them apart).
ANY_DOMAIN = "*"
# Two-input ops whose inputs may be swapped.
COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "And", "Or", "Xor", "Equal", "Sum"})

Bindings = dict[Any, "Value | Node | None"]
ValueTest = Callable[[Value], bool]
ArrayTest = Callable[[np.ndarray], bool]


class Pattern:
    """A pattern entry; match it with :func:`match`."""

    key: Any


@dataclass(frozen=True, eq=False)
class Var(Pattern):
    """Any value; every use of the same name binds the same value."""

    name: str
    test: ValueTest | None = None

    @property
    def key(self) -> Any:
        return self.name


@dataclass(frozen=True, eq=False)
class Const(Pattern):
    """A compile-time constant (an initializer or a Constant node), optionally tested."""

    name: str = ""
    test: ArrayTest | None = None
    rank: int | None = None

    @property
    def key(self) -> Any:
        return self.name or id(self)


@dataclass(frozen=True, eq=False)
class Either(Pattern):
    """The first alternative that matches (each tried in turn on backtracking)."""

    alternatives: tuple[Pattern, ...]

    @property
    def key(self) -> Any:
        return id(self)


@dataclass(frozen=True, eq=False)
class Optional(Pattern):
    """An input that may be omitted (binds None) or matches ``pattern``."""

    pattern: Pattern

    @property
    def key(self) -> Any:
        return id(self)


@dataclass(frozen=True, eq=False)
class OpPattern(Pattern):
    """A node of one of ``op_types`` in ``domain`` whose output ``output`` is matched."""

    op_types: tuple[str, ...]
    inputs: tuple[Pattern, ...]
    domain: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    where: Callable[[Node], bool] | None = None
    output: int = 0
    commute: bool = True

    @property
    def key(self) -> Any:
        return self.name or id(self)


@dataclass(frozen=True, eq=False)
class Polynomial(Pattern):
    """A value computed from the bound variable ``of`` and scalar constants by Add, Sub, Mul, Neg, Div by a
    constant and Pow to a small whole power, in any factorization, whose coefficients (degree -> coefficient)
    pass ``test``. ``test`` also gets the relative spacing of the variable's float type (float32's when the
    type is unknown): a float16 model stores its constants rounded to 2**-11, so a test that knows the
    number they stand for must allow that. It binds the nodes it covers (under ``(name, i)``), so they go
    with the match."""

    of: Var
    test: Callable[[dict[int, float], float], bool]
    name: str = ""

    @property
    def key(self) -> Any:
        return self.name or id(self)


@dataclass(frozen=True, eq=False)
class Chain(Pattern):
    """A run of nodes of ``op_types`` (standard domains), each reading the one before through the input ``via``
    picks (the first input by default; None ends the run), from the matched value back to a value that matches
    ``of``: at least ``least`` and at most ``most`` nodes, the longest run first and each shorter one on
    backtracking. The nodes bind under ``(name, i)``, nearest the matched value first."""

    op_types: tuple[str, ...]
    of: Pattern
    name: str = ""
    least: int = 0
    most: int = 16
    via: Callable[[Node], Value | None] | None = None

    @property
    def key(self) -> Any:
        return self.name or id(self)


class _OpFactory:
    """``op.Mul(a, b, name="scale", axis=-1)``: an :class:`OpPattern`; ``op("Add", "Sub", ...)``
    for several op types. Reserved keywords: name, domain, where, output, commute."""

    def __getattr__(self, op_type: str) -> Callable[..., OpPattern]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        return lambda *inputs, **kw: self.any_of((op_type,), *inputs, **kw)

    def any_of(
        self,
        op_types: Sequence[str],
        *inputs: Pattern,
        name: str = "",
        domain: str = "",
        where: Callable[[Node], bool] | None = None,
        output: int = 0,
        commute: bool = True,
        **attrs: Any,
    ) -> OpPattern:
        return OpPattern(tuple(op_types), tuple(inputs), domain, attrs, name, where, output, commute)


op = _OpFactory()


def var(name: str, test: ValueTest | None = None) -> Var:
    return Var(name, test)


def const(value: float | None = None, *, name: str = "", rank: int | None = None, tol: float = 1e-6) -> Const:
    """A constant; with ``value``, every element must be within ``tol`` (relative) of it."""
    return Const(name, None if value is None else scalar(value, tol), rank)


def scalar(value: float, tol: float = 1e-6) -> ArrayTest:
    """A test: every element of the array is ``value`` (within ``tol``, relative)."""

    def test(array: np.ndarray) -> bool:
        if array.size == 0 or not is_number_array(array):
            return False
        return bool(np.all(np.abs(array.astype(np.float64) - value) <= tol * max(1.0, abs(value))))

    return test


def polynomial(of: Var, test: Callable[[dict[int, float], float], bool], *, name: str = "") -> Polynomial:
    return Polynomial(of, test, name)


def chain(
    op_types: Sequence[str],
    of: Pattern,
    *,
    name: str = "",
    least: int = 0,
    most: int = 16,
    via: Callable[[Node], Value | None] | None = None,
) -> Chain:
    """``chain(("Unsqueeze", "Cast"), var("m"), name="mask")``: ``m`` behind any run of those ops.
    ``via=`` walks through another input than the first (a Mul's scalar may be either operand)."""
    return Chain(tuple(op_types), of, name, least, most, via)


def either(*alternatives: Pattern) -> Either:
    return Either(tuple(alternatives))


def optional(pattern: Pattern) -> Optional:
    return Optional(pattern)


# -- matching ---------------------------------------------------------------------------------


def match(pattern: Pattern, value: Value | None, bindings: Bindings | None = None) -> Iterator[Bindings]:
    """Every way ``value`` matches ``pattern`` extending ``bindings`` (not mutated)."""
    env: Bindings = {} if bindings is None else bindings
    if isinstance(pattern, Optional):
        if value is None:
            yield env
        else:
            yield from match(pattern.pattern, value, env)
        return
    if value is None:
        return
    if isinstance(pattern, Either):
        for alternative in pattern.alternatives:
            yield from match(alternative, value, env)
    elif isinstance(pattern, Var):
        yield from _bind(env, pattern.key, value, lambda: pattern.test is None or pattern.test(value))
    elif isinstance(pattern, Const):
        yield from _bind(env, pattern.key, value, lambda: _const_fits(pattern, value))
    elif isinstance(pattern, OpPattern):
        yield from _match_op(pattern, value, env)
    elif isinstance(pattern, Polynomial):
        yield from _match_polynomial(pattern, value, env)
    elif isinstance(pattern, Chain):
        yield from _match_chain(pattern, value, env)
    else:
        raise TypeError(f"not a pattern: {pattern!r}")


def _bind(env: Bindings, key: Any, value: Value, test: Callable[[], bool]) -> Iterator[Bindings]:
    if key in env:
        if env[key] is value:
            yield env
        return
    if test():
        yield {**env, key: value}


def _const_fits(pattern: Const, value: Value) -> bool:
    if not is_constant(value):
        return False
    if pattern.rank is not None:
        kind = value.type
        if not isinstance(kind, TensorType) or kind.rank != pattern.rank:
            return False
    if pattern.test is None:
        return True
    array = constant_array(value)
    return array is not None and pattern.test(array)


def _match_op(pattern: OpPattern, value: Value, env: Bindings) -> Iterator[Bindings]:
    node = value.producer
    if node is None or value.index != pattern.output or node.op_type not in pattern.op_types:
        return
    if pattern.domain in STANDARD_DOMAINS:
        if not node.in_standard_domain:
            return
    elif pattern.domain != ANY_DOMAIN and node.domain != pattern.domain:
        return
    key = pattern.key
    if key in env:
        if env[key] is node:
            yield env
        return
    if any(n is node for n in env.values()):
        return  # two different entries never match one node (a shared entry is one object)
    if not all(_attr_fits(node, name, want) for name, want in pattern.attrs.items()):
        return
    if pattern.where is not None and not _holds(pattern.where, node):
        return
    env = {**env, key: node}
    actual = list(node.inputs)
    wanted = list(pattern.inputs)
    if len(actual) > len(wanted) and any(v is not None for v in actual[len(wanted) :]):
        return
    actual += [None] * (len(wanted) - len(actual))
    orders: list[list[Value | None]] = [actual[: len(wanted)]]
    if pattern.commute and len(wanted) == 2 and node.op_type in COMMUTATIVE:
        orders.append([actual[1], actual[0]])
    for order in orders:
        yield from _match_inputs(wanted, order, env)


class PredicateFailed(Exception):
    """A ``where=`` predicate raised (the exception is the cause): the failure of the rule
    being matched, at its root, as an exception from its plan is."""


def _holds(where: Callable[[Node], bool], node: Node) -> bool:
    try:
        return bool(where(node))
    except GraphoptError:
        raise
    except Exception as err:
        raise PredicateFailed(f"{type(err).__name__}: {err}") from err


def _match_inputs(wanted: list[Pattern], actual: list[Value | None], env: Bindings) -> Iterator[Bindings]:
    if not wanted:
        yield env
        return
    for extended in match(wanted[0], actual[0], env):
        yield from _match_inputs(wanted[1:], actual[1:], extended)


def _match_chain(pattern: Chain, value: Value, env: Bindings) -> Iterator[Bindings]:
    run: list[Node] = []
    sources: list[Value] = [value]  # sources[i]: what the run of its i nearest nodes reads
    while len(run) < pattern.most:
        node = sources[-1].producer
        if node is None or node.op_type not in pattern.op_types or not node.in_standard_domain:
            break
        source = pattern.via(node) if pattern.via is not None else (node.inputs[0] if node.inputs else None)
        if source is None:
            break
        run.append(node)
        sources.append(source)
    taken = {id(n) for n in env.values() if isinstance(n, Node)}
    for length in range(len(run), pattern.least - 1, -1):
        nodes = run[:length]
        if taken & {id(n) for n in nodes}:
            continue
        yield from match(pattern.of, sources[length], {**env, **{(pattern.key, i): n for i, n in enumerate(nodes)}})


# The most nodes and the highest degree a Polynomial reads (GELU's argument has 2 to 5 nodes, degree 3).
POLYNOMIAL_NODES, POLYNOMIAL_DEGREE = 12, 6
Coefficients = dict[int, float]


def _match_polynomial(pattern: Polynomial, value: Value, env: Bindings) -> Iterator[Bindings]:
    variable = env.get(pattern.of.key)
    if not isinstance(variable, Value):
        return  # the variable is bound by the entries before this one
    nodes: dict[int, Node] = {}
    found = _coefficients(value, variable, nodes, {})
    taken = {id(n) for n in env.values() if isinstance(n, Node)}
    if found is None or taken & set(nodes) or not pattern.test(found, _epsilon(variable)):
        return
    yield {**env, **{(pattern.key, i): node for i, node in enumerate(nodes.values())}}


def _epsilon(value: Value) -> float:
    dtype = value.type.dtype if isinstance(value.type, TensorType) else None
    found = dtype.epsilon if dtype is not None else None
    return DataType.FLOAT.epsilon if found is None else found  # type: ignore[return-value]


def _coefficients(value: Value, x: Value, nodes: dict[int, Node], seen: dict[int, Coefficients]) -> Coefficients | None:
    """``value`` as a polynomial in ``x`` (degree -> coefficient), collecting its nodes; None: it is not one."""
    if value is x:
        return {1: 1.0}
    if id(value) in seen:
        return seen[id(value)]
    if is_constant(value):
        array = constant_array(value)
        if array is None or array.size != 1 or not is_number_array(array):  # Pow may take an int exponent
            return None
        return {0: float(array.ravel()[0])}
    node = value.producer
    if node is None or not node.in_standard_domain or len(node.outputs) != 1 or len(nodes) >= POLYNOMIAL_NODES:
        return None
    nodes[id(node)] = node
    terms = [_coefficients(v, x, nodes, seen) if v is not None else None for v in node.inputs]
    if not terms or any(t is None for t in terms):
        return None
    found = _combine(node.op_type, terms)  # type: ignore[arg-type]
    if found is None or max(found, default=0) > POLYNOMIAL_DEGREE:
        return None
    seen[id(value)] = found
    return found


def _combine(op_type: str, terms: list[Coefficients]) -> Coefficients | None:
    first = terms[0]
    if op_type == "Neg" and len(terms) == 1:
        return {d: -c for d, c in first.items()}
    if len(terms) != 2:
        return None
    second = terms[1]
    if op_type in ("Add", "Sub"):
        sign = 1.0 if op_type == "Add" else -1.0
        total = dict(first)
        for degree, c in second.items():
            total[degree] = total.get(degree, 0.0) + sign * c
        return total
    if op_type == "Mul":
        product: Coefficients = {}
        for a, ca in first.items():
            for b, cb in second.items():
                product[a + b] = product.get(a + b, 0.0) + ca * cb
        return product
    constant = second.get(0) if set(second) == {0} else None
    if op_type == "Div" and constant:
        return {d: c / constant for d, c in first.items()}
    if (
        op_type == "Pow"
        and constant is not None
        and float(constant).is_integer()
        and 1 <= constant <= POLYNOMIAL_DEGREE
    ):
        power: Coefficients = {0: 1.0}
        for _ in range(int(constant)):
            power = _combine("Mul", [power, first]) or {}
        return power
    return None


def _attr_fits(node: Node, name: str, want: Any) -> bool:
    have = node.attr(name)
    if callable(want):
        return bool(want(have))
    if have is None:
        return want is None
    if isinstance(want, (list, tuple)) and isinstance(have, (list, tuple)):
        return len(want) == len(have) and all(a == b for a, b in zip(want, have, strict=True))
    if isinstance(want, str) and isinstance(have, bytes):
        return have.decode() == want
    return bool(have == want)


def entries(pattern: Pattern) -> Iterator[Pattern]:
    """Every entry of ``pattern``, each once (a shared entry is listed the first time)."""
    seen: set[int] = set()
    pending = [pattern]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, OpPattern):
            pending.extend(reversed(current.inputs))
        elif isinstance(current, Either):
            pending.extend(reversed(current.alternatives))
        elif isinstance(current, Optional):
            pending.append(current.pattern)
        elif isinstance(current, (Polynomial, Chain)):
            pending.append(current.of)


def required_ops(pattern: Pattern) -> frozenset[frozenset[str]]:
    """What every match of ``pattern`` needs among its graph's nodes: clauses, each the op types of which
    one at least must be there. A graph that lacks a clause has no match (its rule need not be tried)."""
    if isinstance(pattern, OpPattern):
        return frozenset({frozenset(pattern.op_types)}).union(*(required_ops(p) for p in pattern.inputs))
    if isinstance(pattern, Chain):
        own = frozenset({frozenset(pattern.op_types)}) if pattern.least > 0 else frozenset()
        return own | required_ops(pattern.of)
    if isinstance(pattern, Either):  # what every alternative needs
        return frozenset.intersection(*(required_ops(p) for p in pattern.alternatives))
    return frozenset()  # a leaf, an optional input, or a polynomial (which may be its variable alone)


def root_ops(pattern: Pattern) -> frozenset[str] | None:
    """The op types a root node may have (None: any node, for an Either of leaves)."""
    if isinstance(pattern, OpPattern):
        return frozenset(pattern.op_types)
    if isinstance(pattern, Either):
        found: set[str] = set()
        for alternative in pattern.alternatives:
            ops = root_ops(alternative)
            if ops is None:
                return None
            found |= ops
        return frozenset(found)
    return None
