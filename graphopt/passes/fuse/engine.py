"""The fuse / shatter engine: rules as data, one matcher, one driver.

A :class:`Rule` is a pattern (:mod:`graphopt.passes.fuse.patterns`), an optional ``check``
that returns the reason a structural match cannot be rewritten (None: go ahead), and a
``rewrite`` that builds the replacement through a toolkit Builder and returns the values
that stand for the root's outputs. Rules live in a registry in registration order; the
built-in families register themselves from ``rules/``, and users add their own with
:func:`add_rule`.

One round over a graph (:func:`run_round`):

1. Walk the nodes from the outputs backwards (reverse topological order). At each node
   not yet covered, try every rule whose pattern can be rooted at its op type; a match is
   valid when no entry but the root has a reader outside the match (a graph output counts
   as a reader), its opset gate holds, it overlaps no covered node, and ``check`` agrees.
2. LARGEST_MATCH: among the valid matches rooted at the node the one covering most nodes
   wins; ties go to the rule registered first, then to the matcher's first binding. Its
   nodes are covered and keep this match for the round.
3. Apply the chosen matches in walk order: the rewrite builds new nodes before the root,
   then ``replace_nodes`` swaps them in (graph outputs keep their names).

A structural match refused by a gate, a reader outside it, or its check is a near miss;
near misses whose root no other match covered are reported per family with the reason.
The pass (:mod:`graphopt.passes.fuse.fuse_pass`) runs the shatter rules, then the fuse
rules, until a round changes nothing or ``max_steps`` rounds ran.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from graphopt.errors import InputError
from graphopt.ir import DataType, Graph, Model, Node, Value, tensor_dtype, tensor_shape
from graphopt.ir.constness import constant_array
from graphopt.ir.rewrite import Builder, replace_nodes
from graphopt.passes.base import PassContext
from graphopt.passes.fuse.patterns import Bindings, OpPattern, Pattern, entries, match, root_ops

__all__ = [
    "Match",
    "Rule",
    "RunStats",
    "Site",
    "add_rule",
    "registered_rules",
    "remove_rule",
    "run_round",
]

Kind = Literal["fuse", "shatter"]
Rewrite = Callable[[Builder, "Match", "Site"], "Value | Sequence[Value] | None"]
Check = Callable[["Match", "Site"], "str | None"]

# The most bindings examined per rule and root (commuted orders multiply quickly).
MAX_BINDINGS = 64
# Near misses kept per family in the report (the count covers all of them).
MAX_NEAR_MISSES = 20
# The most nodes of shape plumbing that may go with a match (see _outside_readers).
MAX_FEEDERS = 64
# Constant weights a rewrite may read (a Conv's weight, a MatMul's matrix).
WEIGHT_READ_LIMIT = 1 << 28


@dataclass(frozen=True)
class Site:
    """Where a match was found: the model, graph and opset a check or rewrite works at.

    ``opset`` is the default-domain opset the graph has after the pass (the target opset
    when the model is being lowered); ``target`` is "onnx" or "ort".
    """

    model: Model
    graph: Graph
    opset: int
    target: str
    ctx: PassContext

    @staticmethod
    def shape(value: Value | None) -> tuple[Any, ...] | None:
        return tensor_shape(value)

    @staticmethod
    def rank(value: Value | None) -> int | None:
        shape = Site.shape(value)
        return None if shape is None else len(shape)

    @staticmethod
    def dtype(value: Value | None) -> DataType | None:
        return tensor_dtype(value)

    @staticmethod
    def array(value: Value | None, limit: int = WEIGHT_READ_LIMIT) -> np.ndarray | None:
        """A constant's values (read-only), or None."""
        return constant_array(value, limit)

    def domain_opset(self, domain: str) -> int:
        return self.model.opset_in(self.graph, domain)


class Match:
    """One way a rule's pattern matched at ``root``: named bindings and the covered nodes."""

    def __init__(self, rule: Rule, root: Node, bindings: Bindings) -> None:
        self.rule = rule
        self.root = root
        self.bindings = bindings
        self.order = root.graph.positions() if root.graph is not None else {}
        found = {id(v): v for v in bindings.values() if isinstance(v, Node)}
        self.nodes: list[Node] = sorted(found.values(), key=lambda n: self.order.get(id(n), 0))
        # Readers outside the match whose results feed only the match; they go with it.
        self.feeders: list[Node] = []
        # Exported entries' replacements (see Rule.exports), set by the rewrite.
        self.exported: dict[Value, Value] = {}

    def __contains__(self, name: str) -> bool:
        return self.bindings.get(name) is not None

    def value(self, name: str) -> Value:
        found = self.bindings.get(name)
        if not isinstance(found, Value):
            raise KeyError(f"rule {self.rule.name}: {name!r} is not a bound value")
        return found

    def optional(self, name: str) -> Value | None:
        found = self.bindings.get(name)
        return found if isinstance(found, Value) else None

    def node(self, name: str) -> Node:
        found = self.bindings.get(name)
        if not isinstance(found, Node):
            raise KeyError(f"rule {self.rule.name}: {name!r} is not a bound node")
        return found

    def export(self, name: str, value: Value) -> None:
        """Let ``value`` stand for the output of the exported entry ``name`` (Rule.exports)."""
        self.exported[self.node(name).outputs[0]] = value

    def where(self) -> str:
        """A readable location: the root's name, else its first output's name."""
        return self.root.name or self.root.outputs[0].name


@dataclass(frozen=True)
class Rule:
    """A named pattern with its check and rewrite (see the module docstring).

    ``min_opset`` / ``max_opset`` gate the rule on the default-domain opset of the site (a
    shatter rule with ``max_opset`` lowers: it is tried only when the run takes the graph
    below its own opset, see :meth:`retired`);
    ``targets`` lists the targets it may emit for; ``default`` False leaves it off unless
    the pass's ``enable`` option names it. ``label`` names what it fuses in near-miss
    reasons ("LayerNorm at /enc/ln1: gamma is not constant"). ``exports`` names entries whose
    (single) output may be read outside the match or be a graph output; the rewrite calls
    ``m.export(name, value)`` with what stands for it (a fused op's second output, such as
    SkipLayerNormalization's residual sum).
    """

    name: str
    family: str
    pattern: Pattern
    rewrite: Rewrite
    check: Check | None = None
    kind: Kind = "fuse"
    min_opset: int = 1
    max_opset: int | None = None
    targets: frozenset[str] = frozenset({"onnx", "ort"})
    default: bool = True
    label: str = ""
    doc: str = ""
    exports: tuple[str, ...] = ()

    @property
    def what(self) -> str:
        return self.label or self.family

    def gate(self, site: Site) -> str | None:
        """Why the rule cannot apply at ``site`` whatever matched (None: it can)."""
        if site.opset < self.min_opset:
            return f"needs opset >= {self.min_opset} (the model has {site.opset}; see --target-opset)"
        return None

    def retired(self, site: Site) -> bool:
        """Whether the rule is not tried at ``site`` at all: its opset is past ``max_opset``, or
        the rule lowers (a shatter rule with ``max_opset``) and the run does not (the goal is
        the graph's own opset). A lowering rule so reports no near misses on a normal run."""
        if self.max_opset is None:
            return False
        lowers = self.kind == "shatter"
        return site.opset > self.max_opset or (lowers and site.opset >= site.model.opset_in(site.graph))


_RULES: dict[str, Rule] = {}


def add_rule(rule: Rule, *, replace: bool = False) -> Rule:
    """Register ``rule`` (its name must be new unless ``replace``); returns it."""
    if not rule.name or not rule.family:
        raise ValueError("a rule needs a name and a family")
    if rule.name in _RULES and not replace:
        raise ValueError(f"a fuse rule named {rule.name!r} is already registered")
    if root_ops(rule.pattern) is None:
        raise ValueError(f"rule {rule.name!r}: the pattern's root must be an op (op.X(...))")
    _RULES[rule.name] = rule
    return rule


def remove_rule(name: str) -> None:
    _RULES.pop(name, None)


def registered_rules() -> list[Rule]:
    """Every registered rule, in registration order (the built-in families included)."""
    from graphopt.passes.fuse import rules  # noqa: F401  (registers the built-in families)

    return list(_RULES.values())


def select_rules(names_on: Iterable[str], names_off: Iterable[str], target: str) -> list[Rule]:
    """The rules a run uses: the defaults plus ``names_on``, minus ``names_off``, for ``target``."""
    known = {r.name: r for r in registered_rules()}
    families = {r.family for r in known.values()}
    on, off = set(names_on), set(names_off)
    for name in on | off:
        if name not in known and name not in families:
            raise InputError(f"fuse: unknown rule or family {name!r}; see `graphopt passes`")
    chosen = []
    for rule in known.values():
        wanted = rule.default or rule.name in on or rule.family in on
        if wanted and rule.name not in off and rule.family not in off and target in rule.targets:
            chosen.append(rule)
    return chosen


@dataclass
class RunStats:
    """What the pass reports: matches applied per rule, near misses per family."""

    applied: Counter[str] = field(default_factory=Counter)
    near_misses: dict[str, list[str]] = field(default_factory=dict)
    near_miss_counts: Counter[str] = field(default_factory=Counter)

    def miss(self, rule: Rule, where: str, reason: str) -> None:
        self.near_miss_counts[rule.family] += 1
        kept = self.near_misses.setdefault(rule.family, [])
        message = f"{rule.what} at {where}: {reason}"
        if len(kept) < MAX_NEAR_MISSES and message not in kept:
            kept.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {
            "applied": dict(sorted(self.applied.items())),
            "near_misses": {f: {"count": self.near_miss_counts[f], "examples": m} for f, m in self.near_misses.items()},
        }


def _outside_readers(m: Match) -> str | None:
    """Why an entry other than the root cannot go: a graph output, or a reader outside.

    A reader outside whose results, however far followed, feed only the match (shape
    plumbing such as ``Shape(q) -> Gather -> Slice`` that builds a mask the match uses) is
    no obstacle: it joins ``m.feeders`` and goes with the match; the rewrite must not read
    its values (:func:`apply_match` checks).
    """
    inside = {id(n) for n in m.nodes}
    exported = {id(m.bindings.get(name)) for name in m.rule.exports}
    feeders: dict[int, Node] = {}
    for node in m.nodes:
        if node is m.root or (id(node) in exported and len(node.outputs) == 1):
            continue
        for value in node.outputs:
            if value.is_graph_output:
                return f"{value.name!r} is a graph output"
            for use in value.uses():
                if id(use.node) not in inside and not _feeds_only(use.node, inside, feeders):
                    reader = use.node.name or use.node.op_type
                    return f"{value.name!r} is also read by {reader}"
    m.feeders = sorted(feeders.values(), key=lambda n: m.order.get(id(n), 0))
    return None


def _feeds_only(start: Node, inside: set[int], feeders: dict[int, Node]) -> bool:
    """Whether everything ``start`` computes flows only into ``inside`` (collecting the nodes)."""
    found: dict[int, Node] = {}
    pending = [start]
    while pending:
        node = pending.pop()
        if id(node) in found or id(node) in feeders:
            continue
        if len(found) > MAX_FEEDERS or any(True for _ in node.subgraphs()):
            return False
        found[id(node)] = node
        for value in node.outputs:
            if value.is_graph_output:
                return False
            for use in value.uses():
                if id(use.node) not in inside:
                    pending.append(use.node)
    feeders.update(found)
    return True


def _candidates(rule: Rule, root: Node, site: Site) -> Iterator[Match]:
    index = _root_output_pattern(rule)
    found = match(rule.pattern, root.outputs[index] if index < len(root.outputs) else None)
    for bindings in itertools.islice(found, MAX_BINDINGS):
        m = Match(rule, root, bindings)
        inside = {id(n) for n in m.nodes}
        # A leaf computed inside the match (Add(p, p) for MatMul + bias) would outlive its producer.
        leaves_outside = not any(isinstance(v, Value) and id(v.producer) in inside for v in bindings.values())
        if m.nodes and leaves_outside and all(n.graph is root.graph for n in m.nodes) and root in m.nodes:
            yield m


# What a check or rewrite raises on a node it cannot read (an attribute of another kind, a
# string constant where a number was expected): the rule does not apply there.
_UNREADABLE = (ValueError, TypeError, IndexError, KeyError, AttributeError)


def _valid(m: Match, site: Site) -> str | None:
    reason = m.rule.gate(site) or _outside_readers(m)
    if reason is None and m.rule.check is not None:
        try:
            reason = m.rule.check(m, site)
        except _UNREADABLE as err:
            reason = f"the match cannot be read ({type(err).__name__}: {err})"
    return reason


def _root_output_pattern(rule: Rule) -> int:
    pattern = rule.pattern
    return pattern.output if isinstance(pattern, OpPattern) else 0


def find_matches(graph: Graph, rules: Sequence[Rule], site: Site, stats: RunStats) -> list[Match]:
    """The matches one round applies, in walk order (outputs backwards)."""
    by_op: dict[str, list[tuple[int, Rule]]] = {}
    for index, rule in enumerate(rules):
        if rule.retired(site):
            continue
        for op_type in root_ops(rule.pattern) or ():
            by_op.setdefault(op_type, []).append((index, rule))
    covered: set[int] = set()
    chosen: list[Match] = []
    misses: list[tuple[Node, Rule, str, str]] = []
    for node in reversed(graph.topological()):
        if id(node) in covered:
            continue
        best: tuple[int, int, Match] | None = None
        for index, rule in by_op.get(node.op_type, ()):
            refusal: str | None = None
            for m in _candidates(rule, node, site):
                if any(id(n) in covered for n in m.nodes):
                    continue
                reason = _valid(m, site)
                if reason is not None:
                    refusal = refusal or reason
                    continue
                if any(id(n) in covered for n in m.feeders):
                    continue
                rank = (-len(m.nodes), index)
                if best is None or rank < best[:2]:
                    best = (rank[0], rank[1], m)
                refusal = None
                break
            if refusal is not None:
                misses.append((node, rule, node.name or node.outputs[0].name, refusal))
        if best is not None:
            covered.update(id(n) for n in [*best[2].nodes, *best[2].feeders])
            chosen.append(best[2])
    for node, rule, where, reason in misses:
        if id(node) not in covered:
            stats.miss(rule, where, reason)
    return chosen


def apply_match(m: Match, site: Site) -> bool:
    """Rewrite one match; False when the rewrite declined (nothing changed)."""
    ctx, model, graph = site.ctx, site.model, site.graph
    builder = ctx.builder(model, graph, before=m.root, tag=m.rule.name)
    try:
        result = m.rule.rewrite(builder, m, site)
    except _UNREADABLE:
        result = None  # declined, like a rewrite that returns None
    if result is None:
        if builder.created:
            graph.remove(list(reversed(builder.created)))
        return False
    new = [result] if isinstance(result, Value) else list(result)
    old = list(m.root.outputs)
    if len(new) > len(old) or any(v.is_used() for v in old[len(new) :]):
        raise ValueError(f"rule {m.rule.name}: the rewrite must stand for every used output of the root")
    inside = {id(n) for n in [*m.nodes, *m.feeders]}
    if any(v is not None and id(v.producer) in inside for n in builder.created for v in n.inputs):
        # An entry value computed inside the match itself (Add(MatMul(a, w), f(MatMul(a, w)))):
        # the nodes it needs go with the match, so the rewrite cannot stand; decline it.
        graph.remove(list(reversed(builder.created)))
        return False
    replacements = dict(zip(old, new, strict=False))
    for name in m.rule.exports:
        value = m.node(name).outputs[0] if name in m else None
        if value is not None and value not in m.exported and _read_outside(value, inside):
            raise ValueError(f"rule {m.rule.name}: the exported entry {name!r} is read outside and was not given")
    replacements.update(m.exported)
    for before, after in replacements.items():
        if after.type is None:
            after.type = before.type
    replace_nodes([*m.feeders, *m.nodes], replacements, ctx.names(model))
    return True


def _read_outside(value: Value, inside: set[int]) -> bool:
    return value.is_graph_output or any(id(use.node) not in inside for use in value.uses())


def run_round(model: Model, rules: Sequence[Rule], site_for: Callable[[Graph], Site], stats: RunStats) -> int:
    """One round of ``rules`` over every graph of ``model``; the number of rewrites."""
    applied = 0
    for graph in list(model.all_graphs()):
        site = site_for(graph)
        for m in find_matches(graph, rules, site, stats):
            if apply_match(m, site):
                stats.applied[m.rule.name] += 1
                applied += 1
    return applied


def pattern_ops(rule: Rule) -> set[str]:
    """The op types a rule's pattern mentions (for the docs and `graphopt passes`)."""
    return {t for p in entries(rule.pattern) if isinstance(p, OpPattern) for t in p.op_types}
