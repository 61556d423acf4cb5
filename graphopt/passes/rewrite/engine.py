"""The rewrite engine: rules as data, one matcher, one driver (the fuse and noop passes).

A :class:`Rule` is a pattern (:mod:`graphopt.passes.rewrite.patterns`), an optional ``plan``
and a ``build``. ``plan(m, site)`` runs once per structural match: it returns
``Refuse(reason)``, why the match cannot be rewritten, or the plan (any other value, None
included) that ``build(b, m, plan)`` then turns into the replacement through a toolkit
Builder, returning the values that stand for the root's outputs. ``Rule[P]`` is generic over
the plan's type, so that a rule's plan and build type-check together. Rules are grouped as
:class:`RuleSet` values, composed with ``+`` in the order that breaks ties; the engine knows
no rule library.

One round over a graph (:func:`run_round`):

1. Walk the nodes from the outputs backwards (reverse topological order). At each node
   not yet covered, try every rule whose pattern can be rooted at its op type; a match is
   valid when no entry but the root has a reader outside the match (a graph output counts
   as a reader), its opset gate holds, it overlaps no covered node, and its plan agrees.
2. LARGEST_MATCH: among the valid matches rooted at the node the one covering most nodes
   wins; ties go to the rule earlier in the rule set, then to the matcher's first binding.
   Its nodes are covered and keep this match for the round.
3. Apply the chosen matches in walk order: the build makes new nodes before the root, the
   engine checks that each replacement keeps the element type and shape of the value it
   replaces (where both are known) and that each op built takes its element types at the
   model's opset (onnx's schema: signatures.py), then ``replace_nodes`` swaps them in (graph outputs keep
   their names). A match that a rewrite applied before it gave a reader outside (a plan may
   read past its pattern) waits for the next round, whose finder sees that reader.

:func:`sweep` applies single-node rules (the noop family) in topological order instead, each
at once, so a chain such as ``Identity(Identity(x))`` goes in one pass.

A structural match refused by a gate, a reader outside it, its plan or the type guard is a
near miss; near misses whose root no other match covered are reported per family with the
reason. A rule that cannot read its match raises :class:`Unreadable` (a refusal); any other
exception from its plan, its build or a ``where=`` predicate of its pattern is that rule's
failure there (:class:`RuleFailed`): the rewrite is undone (the nodes and constants its build
made go), the rule is not tried at that root again in the run, the other rules go on, and
:attr:`RunStats.failures` carries it to the pass's result, which the pipeline reports as it
reports a failing pass.
"""

from __future__ import annotations

import itertools
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from graphopt.errors import GraphoptError, bounded
from graphopt.ir import AttrKind, DataType, Graph, Model, Node, Value, tensor_dtype, tensor_shape
from graphopt.ir.constness import constant_array
from graphopt.ir.rewrite import Builder, replace_nodes
from graphopt.passes.base import Failure, PassContext
from graphopt.passes.rewrite.patterns import (
    Bindings,
    OpPattern,
    Pattern,
    PredicateFailed,
    entries,
    match,
    required_ops,
    root_ops,
)
from graphopt.passes.rewrite.qdq import hidden, quantized
from graphopt.passes.rewrite.signatures import untaken_type

__all__ = [
    "Build",
    "Match",
    "Plan",
    "Refuse",
    "Rule",
    "RuleFailed",
    "RuleSet",
    "RunStats",
    "Site",
    "Unreadable",
    "run_round",
    "sweep",
]

# "late": a fuse rule the fuse pass runs only with its ``late`` option, once the others are done.
Kind = Literal["fuse", "shatter", "late"]
# What a rule's plan hands its build (see Rule).
P = TypeVar("P")


@dataclass(frozen=True)
class Refuse:
    """A plan's answer when the match cannot be rewritten: ``reason`` is the report's near miss."""

    reason: str


# A plan refuses the match, or gives the plan handed to the build.
Plan = Callable[["Match", "Site"], "P | Refuse"]
Build = Callable[[Builder, "Match", P], "Value | Sequence[Value]"]

# The most bindings examined per rule and root (commuted orders multiply quickly).
MAX_BINDINGS = 64
# Near misses kept per family in the report (the count covers all of them).
MAX_NEAR_MISSES = 20
# The most nodes of shape plumbing that may go with a match (see _outside_readers).
MAX_FEEDERS = 64
# Constant weights a rewrite may read (a Conv's weight, a MatMul's matrix).
WEIGHT_READ_LIMIT = 1 << 28


class Unreadable(Exception):
    """The match cannot be read as the rule needs (an attribute or constant of another kind):
    the rule does not apply there, and the reason is a near miss."""


class RuleFailed(Exception):
    """A rule raised something other than :class:`Unreadable`, or its build broke the contract:
    a bug in the rule, at one match."""


@dataclass(frozen=True)
class Site:
    """Where a match was found: the model, graph and opset a plan or build works at.

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

    @staticmethod
    def int_attr(node: Node, name: str, default: int) -> int:
        """Attribute ``name`` of ``node`` as an int (``default`` when absent)."""
        return int(_attr_of_kind(node, name, default, (AttrKind.INT,)))

    @staticmethod
    def float_attr(node: Node, name: str, default: float) -> float:
        """Attribute ``name`` of ``node`` as a float (``default`` when absent)."""
        return float(_attr_of_kind(node, name, default, (AttrKind.FLOAT, AttrKind.INT)))

    @staticmethod
    def ints_attr(node: Node, name: str) -> list[int] | None:
        """Attribute ``name`` of ``node`` as a list of ints (None when absent)."""
        found = _attr_of_kind(node, name, None, (AttrKind.INTS,))
        return None if found is None else [int(v) for v in found]

    def domain_opset(self, domain: str) -> int:
        return self.model.opset_in(self.graph, domain)


def _attr_of_kind(node: Node, name: str, default: Any, kinds: tuple[AttrKind, ...]) -> Any:
    attr = node.attributes.get(name)
    if attr is None:
        return default
    if attr.kind not in kinds or attr.value is None:
        raise Unreadable(f"{node.op_type} attribute {name!r} is a {attr.kind.name.lower()}")
    return attr.value


class Match:
    """One way a rule's pattern matched at ``root``: named bindings, covered nodes and, once
    the rule's plan agreed, that plan."""

    def __init__(self, rule: Rule[Any], root: Node, bindings: Bindings, site: Site) -> None:
        self.rule = rule
        self.root = root
        self.site = site
        self.bindings = bindings
        found = [v for v in bindings.values() if isinstance(v, Node)]
        self.nodes: list[Node] = root.graph.ordered(found) if root.graph is not None else found
        # Readers outside the match whose results feed only the match; they go with it.
        self.feeders: list[Node] = []
        # Exported entries' replacements (see Rule.exports), set by the build.
        self.exported: dict[Value, Value] = {}
        self.plan: Any = None

    def __contains__(self, name: str) -> bool:
        return self.bindings.get(name) is not None

    def value(self, name: str) -> Value:
        """The value bound to ``name``; a name the pattern never binds is a bug in the rule."""
        found = self._bound(name)
        if not isinstance(found, Value):
            raise LookupError(f"rule {self.rule.name}: {name!r} is not a bound value")
        return found

    def optional(self, name: str) -> Value | None:
        found = self._bound(name)
        return found if isinstance(found, Value) else None

    def node(self, name: str) -> Node:
        found = self._bound(name)
        if not isinstance(found, Node):
            raise LookupError(f"rule {self.rule.name}: {name!r} is not a bound node")
        return found

    def _bound(self, name: str) -> Value | Node | None:
        if name not in self.rule.names:
            raise LookupError(f"rule {self.rule.name}: its pattern binds no {name!r}")
        return self.bindings.get(name)

    def export(self, name: str, value: Value) -> None:
        """Let ``value`` stand for the output of the exported entry ``name`` (Rule.exports)."""
        self.exported[self.node(name).outputs[0]] = value

    def where(self) -> str:
        """A readable location: the root's name, else its first output's name."""
        return _where(self.root)


def _where(node: Node) -> str:
    return node.name or node.outputs[0].name


@dataclass(frozen=True, eq=False, kw_only=True)
class Rule(Generic[P]):
    """A named pattern with its plan and build (see the module docstring), ``P`` the plan's type.

    ``min_opset`` / ``max_opset`` gate the rule on the default-domain opset of the site (a
    shatter rule with ``max_opset`` lowers: it is tried only when the run takes the graph
    below its own opset, see :meth:`retired`);
    ``targets`` lists the targets it may emit for; ``default`` False leaves it off unless
    the pass's ``enable`` option names it. ``kind`` "late" marks a fuse rule that would take
    nodes other rules fuse: the fuse pass runs it only with its ``late`` option, and only once
    the other rules change nothing more. ``label`` names what it fuses in near-miss
    reasons ("LayerNorm at /enc/ln1: gamma is not constant"). ``exports`` names entries whose
    (single) output may be read outside the match or be a graph output; the build calls
    ``m.export(name, value)`` with what stands for it (a fused op's second output, such as
    SkipLayerNormalization's residual sum). ``through_qdq`` lets the rule match a statically
    quantized model's float computation through its activations' Q/DQ pairs, which its match then
    drops: a fusion computing in float (see :mod:`graphopt.passes.rewrite.qdq`).
    """

    name: str
    family: str
    pattern: Pattern
    build: Build[P]
    plan: Plan[P] | None = None
    kind: Kind = "fuse"
    min_opset: int = 1
    max_opset: int | None = None
    targets: frozenset[str] = frozenset({"onnx", "ort"})
    default: bool = True
    label: str = ""
    doc: str = ""
    exports: tuple[str, ...] = ()
    through_qdq: bool = False

    # The names the pattern binds (what ``m.value`` / ``m.node`` may ask for).
    names: frozenset[str] = field(init=False, repr=False)
    # What a graph needs for the pattern to match in it (patterns.required_ops).
    requires: frozenset[frozenset[str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name or not self.family:
            raise ValueError("a rule needs a name and a family")
        if root_ops(self.pattern) is None:
            raise ValueError(f"rule {self.name!r}: the pattern's root must be an op (op.X(...))")
        bound = frozenset(e.key for e in entries(self.pattern) if isinstance(e.key, str))
        object.__setattr__(self, "names", bound)
        object.__setattr__(self, "requires", required_ops(self.pattern))

    @property
    def what(self) -> str:
        return self.label or self.family

    def gate(self, site: Site) -> str | None:
        """Why the rule cannot apply at ``site`` whatever matched (None: it can)."""
        if site.opset < self.min_opset:
            return f"needs opset >= {self.min_opset} (the model has {site.opset})"
        return None

    def retired(self, site: Site) -> bool:
        """Whether the rule is not tried at ``site`` at all: its opset is past ``max_opset``, or
        the rule lowers (a shatter rule with ``max_opset``) and the run does not (the goal is
        the graph's own opset). A lowering rule so reports no near misses on a normal run."""
        if self.max_opset is None:
            return False
        lowers = self.kind == "shatter"
        return site.opset > self.max_opset or (lowers and site.opset >= site.model.opset_in(site.graph))


class RuleSet:
    """Rules in priority order (earlier wins a LARGEST_MATCH tie), indexed by root op once."""

    def __init__(self, rules: Iterable[Rule[Any]] = ()) -> None:
        self.rules: tuple[Rule[Any], ...] = tuple(rules)
        self._by_op: dict[str, list[tuple[int, Rule[Any]]]] = {}
        for index, rule in enumerate(self.rules):
            for op_type in root_ops(rule.pattern) or ():
                self._by_op.setdefault(op_type, []).append((index, rule))

    def __add__(self, other: RuleSet | Iterable[Rule[Any]]) -> RuleSet:
        return RuleSet([*self.rules, *other])

    def __iter__(self) -> Iterator[Rule[Any]]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def through_qdq(self, withheld: frozenset[str] = frozenset()) -> tuple[RuleSet, RuleSet]:
        """(the rules marked ``through_qdq`` but those of the ``withheld`` families, the others),
        each in priority order."""
        through = [r for r in self.rules if r.through_qdq and r.family not in withheld]
        chosen = {id(r) for r in through}
        return RuleSet(through), RuleSet(r for r in self.rules if id(r) not in chosen)

    def within(self, only: RuleSet | None) -> RuleSet:
        """These rules that ``only`` holds too, in this set's priority order (all of them for None)."""
        if only is None:
            return self
        kept = {id(r) for r in only}
        return RuleSet(r for r in self.rules if id(r) in kept)

    def rooted_at(self, op_type: str) -> list[tuple[int, Rule[Any]]]:
        """(priority, rule) for the rules whose pattern may be rooted at ``op_type``."""
        return self._by_op.get(op_type, [])


@dataclass
class RunStats:
    """What the pass reports: matches applied per rule, near misses per family, and the rules'
    failures (each rewrite undone alone)."""

    applied: Counter[str] = field(default_factory=Counter)
    near_misses: dict[str, list[str]] = field(default_factory=dict)
    near_miss_counts: Counter[str] = field(default_factory=Counter)
    # label -> (the lowest opset that lets one of its rules apply, the places it was refused
    # at for the opset alone, each the names of a match's nodes; overlapping matches of two
    # rules of one label are one place): what a newer --target-opset would fuse.
    below_opset: dict[str, tuple[int, list[frozenset[str]]]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    # Rewrites applied with a QDQ model's pairs hidden (qdq.py), per rule: what the run
    # withdraws when the check refuses the fusions through Q/DQ.
    through_qdq: Counter[str] = field(default_factory=Counter)
    # How many matches the rounds chose, applied or not (a build may refuse one): a round that chose
    # none leaves the same choice to the next round on the same graph.
    chosen: int = 0
    # Per rule, the nodes its rewrites added less those they removed: a rule that writes more
    # than it removes (a float16 op computed in float32 between Casts) is named in the report,
    # with its reason, where the node count grew for it.
    node_delta: Counter[str] = field(default_factory=Counter)
    # (rule, id of root) -> root for each failure: the rule is not tried there again this run
    # (the root is kept so that its id is not reused by a new node).
    _failed_at: dict[tuple[str, int], Node] = field(default_factory=dict)

    def fail(self, rule: Rule[Any], root: Node, err: RuleFailed) -> None:
        """Record ``rule`` failing at ``root`` (called where ``err`` is being handled)."""
        self._failed_at[(rule.name, id(root))] = root
        labels = {"rule": rule.name, "node": _where(root)}
        self.failures.append(Failure(bounded(str(err)), labels, traceback.format_exc()))

    def failed_at(self, rule: Rule[Any], root: Node) -> bool:
        return (rule.name, id(root)) in self._failed_at

    def miss(self, rule: Rule[Any], where: str, reason: str, *, below_opset: frozenset[str] = frozenset()) -> None:
        """Record a near miss; ``below_opset``, the nodes of a match refused for the opset alone."""
        if below_opset:
            opset, places = self.below_opset.get(rule.what, (rule.min_opset, []))
            merged = below_opset.union(*(p for p in places if p & below_opset))
            places = [p for p in places if not p & below_opset] + [merged]
            self.below_opset[rule.what] = (min(opset, rule.min_opset), places)
        self.near_miss_counts[rule.family] += 1
        kept = self.near_misses.setdefault(rule.family, [])
        message = f"{rule.what} at {where}: {reason}"
        if len(kept) < MAX_NEAR_MISSES and message not in kept:
            kept.append(message)

    def as_dict(self) -> dict[str, Any]:
        return {
            "applied": dict(sorted(self.applied.items())),
            "near_misses": {f: {"count": self.near_miss_counts[f], "examples": m} for f, m in self.near_misses.items()},
            "below_opset": {
                what: {"opset": opset, "sites": len(places)}
                for what, (opset, places) in sorted(self.below_opset.items())
            },
            **({"through_qdq": dict(sorted(self.through_qdq.items()))} if self.through_qdq else {}),
            **({"more_nodes": grown} if (grown := {r: n for r, n in sorted(self.node_delta.items()) if n > 0}) else {}),
        }


def _outside_readers(m: Match) -> str | None:
    """Why an entry other than the root cannot go: a graph output, or a reader outside.

    A reader outside whose results, however far followed, feed only the match (shape
    plumbing such as ``Shape(q) -> Gather -> Slice`` that builds a mask the match uses) is
    no obstacle: it joins ``m.feeders`` and goes with the match; the rewrite must not read
    its values (:func:`apply_match` checks).
    """
    inside = {id(n) for n in m.nodes}
    feeders: dict[int, Node] = {}
    for value in _removed_outputs(m, m.nodes):
        reason = _read_beyond(value, inside, feeders)
        if reason is not None:
            return reason
    m.feeders = m.root.graph.ordered(feeders.values()) if m.root.graph is not None else list(feeders.values())
    return None


def _read_beyond(value: Value, inside: set[int], feeders: dict[int, Node]) -> str | None:
    """Why ``value`` is read beyond ``inside``: a graph output, or a reader whose results do not feed only
    ``inside`` (those that do are collected into ``feeders``); None when nothing else reads it."""
    if value.is_graph_output:
        return f"{value.name!r} is a graph output"
    for use in value.uses():
        if id(use.node) not in inside and not _feeds_only(use.node, inside, feeders):
            return f"{value.name!r} is also read by {use.node.name or use.node.op_type}"
    return None


def _quantized_export(m: Match) -> str | None:
    """Why an exported entry cannot be read through its Q/DQ pair: the readers outside would still read
    it quantized (the pair stays for them), the fused op would compute on it unquantized (a residual sum
    whose quantization saturates reaches the outside readers clipped and the fused norm whole). The
    pair's own QuantizeLinear, whose DequantizeLinear only the match read, is no reader outside."""
    inside = {id(n) for n in [*m.nodes, *m.feeders]}
    for name in m.rule.exports:
        value = m.node(name).outputs[0] if name in m else None
        if value is not None and quantized(value, m.site) and _read_beyond(value, inside, {}) is not None:
            return f"{value.name!r} is quantized where the match reads it, and read outside it"
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


def _candidates(rule: Rule[Any], root: Node, site: Site, stats: RunStats) -> Iterator[Match]:
    """The structural matches of ``rule`` at ``root``; none more once a ``where=`` predicate
    raises, which is the rule's failure there (recorded in ``stats``), not the pass's."""
    index = _root_output_pattern(rule)
    found = match(rule.pattern, root.outputs[index] if index < len(root.outputs) else None)
    try:
        for bindings in itertools.islice(found, MAX_BINDINGS):
            m = Match(rule, root, bindings, site)
            inside = {id(n) for n in m.nodes}
            # A leaf computed inside the match (Add(p, p) for MatMul + bias) would outlive its producer.
            leaves_outside = not any(isinstance(v, Value) and id(v.producer) in inside for v in bindings.values())
            if m.nodes and leaves_outside and all(n.graph is root.graph for n in m.nodes) and root in m.nodes:
                yield m
    except PredicateFailed as err:
        failed = f"rule {rule.name!r} failed in its where= predicate at {_where(root)}: {err}"
        stats.fail(rule, root, RuleFailed(failed))


def _guarded(m: Match, step: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``; an exception other than :class:`Unreadable` is the failure of ``m``'s rule."""
    try:
        return call(*args)
    except (Unreadable, GraphoptError):
        raise
    except Exception as err:
        raise _failed(m, f"in its {step}", f"{type(err).__name__}: {err}") from err


def _failed(m: Match, step: str, what: str) -> RuleFailed:
    return RuleFailed(f"rule {m.rule.name!r} failed {step} at {m.where()}: {what}")


def _valid(m: Match, site: Site) -> str | None:
    """Why ``m`` cannot be rewritten (None: it can, and ``m.plan`` holds the rule's plan)."""
    reason = m.rule.gate(site) or _outside_readers(m) or _quantized_export(m)
    if reason is not None or m.rule.plan is None:
        return reason
    try:
        found = _guarded(m, "plan", m.rule.plan, m, site)
    except Unreadable as err:
        return f"the match cannot be read ({err})"
    if isinstance(found, Refuse):
        return found.reason
    m.plan = found
    return None


def _root_output_pattern(rule: Rule[Any]) -> int:
    pattern = rule.pattern
    return pattern.output if isinstance(pattern, OpPattern) else 0


def find_matches(graph: Graph, rules: RuleSet, site: Site, stats: RunStats) -> list[Match]:
    """The matches one round applies, in walk order (outputs backwards)."""
    covered: set[int] = set()
    chosen: list[Match] = []
    misses: list[tuple[Node, Rule[Any], str, str, frozenset[str]]] = []
    order = graph.topological()
    present = {node.op_type for node in order}
    # A rule whose pattern needs an op type the graph lacks has no match in it (attention rules once the
    # attention is fused, in a CNN): it is not tried at each node its root op type has.
    possible = {id(rule) for rule in rules if all(clause & present for clause in rule.requires)}
    for node in reversed(order):
        if id(node) in covered:
            continue
        best: tuple[int, int, Match] | None = None
        for index, rule in rules.rooted_at(node.op_type):
            if id(rule) not in possible or rule.retired(site) or stats.failed_at(rule, node):
                continue
            refusal: str | None = None
            gated: frozenset[str] = frozenset()  # the first refused match's nodes, if the opset refused it
            for m in _candidates(rule, node, site, stats):
                if any(id(n) in covered for n in m.nodes):
                    continue
                try:
                    reason = _valid(m, site)
                except RuleFailed as err:
                    stats.fail(m.rule, m.root, err)
                    refusal = None
                    break
                if reason is not None:
                    if refusal is None and site.opset < rule.min_opset:
                        gated = frozenset(_where(n) for n in m.nodes)
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
                misses.append((node, rule, _where(node), refusal, gated))
        if best is not None:
            covered.update(id(n) for n in [*best[2].nodes, *best[2].feeders])
            chosen.append(best[2])
    for node, rule, where, reason, gated in misses:
        if id(node) not in covered:
            stats.miss(rule, where, reason, below_opset=gated)
    return chosen


def apply_match(m: Match, site: Site, stats: RunStats) -> bool:
    """Rewrite one match; False when it was refused after the build, or its rule failed there
    (the build's nodes and constants go again: nothing changed)."""
    ctx, model = site.ctx, site.model
    nodes_before = len(site.graph)
    if _read_since_found(m):
        return False  # the next round's finder sees the new reader (a near miss if it stands)
    if _entry_gone(m):
        return False  # the next round's finder sees what stands for it
    builder = ctx.builder(model, site.graph, before=m.root, tag=m.rule.name)
    try:
        found = _replacements(builder, m)
    except Unreadable as err:
        found = f"the match cannot be read ({err})"
    except RuleFailed as err:
        stats.fail(m.rule, m.root, err)
        found = None
    if not isinstance(found, dict):
        _undo(builder)
        if found is not None:
            stats.miss(m.rule, m.where(), found)
        return False
    for before, after in found.items():
        if after.type is None:
            after.type = before.type
    replace_nodes([*m.feeders, *m.nodes], found, ctx.names(model))
    stats.node_delta[m.rule.name] += len(site.graph) - nodes_before
    return True


def _replacements(b: Builder, m: Match) -> dict[Value, Value] | str | None:
    """Run the build: the values that replace the root's outputs and the exported entries, or
    why the rewrite is refused (None: declined without a near miss). RuleFailed when the build
    raises or breaks the contract."""
    rule = m.rule
    result = _guarded(m, "build", rule.build, b, m, m.plan)
    new = [result] if isinstance(result, Value) else list(result)
    old = list(m.root.outputs)
    if len(new) > len(old) or any(v.is_used() for v in old[len(new) :]):
        raise _failed(m, "in its build", "the build must stand for every used output of the root")
    inside = {id(n) for n in [*m.nodes, *m.feeders]}
    if any(v is not None and id(v.producer) in inside for n in b.created for v in n.inputs):
        # An entry value computed inside the match itself (Add(MatMul(a, w), f(MatMul(a, w)))):
        # the nodes it needs go with the match, so the rewrite cannot stand.
        return None
    untaken = next((r for n in b.created if (r := untaken_type(n, m.site.opset)) is not None), None)
    if untaken is not None:
        return untaken
    replacements = dict(zip(old, new, strict=False))
    for name in rule.exports:
        value = m.node(name).outputs[0] if name in m else None
        if value is not None and value not in m.exported and _read_outside(value, inside):
            raise _failed(m, "in its build", f"the exported entry {name!r} is read outside and was not given")
    replacements.update(m.exported)
    for before, after in replacements.items():
        changed = _type_change(before, after)
        if changed is not None:
            return changed
    return replacements


def _undo(b: Builder) -> None:
    """Remove what the build made (its nodes, then its constants)."""
    if b.created:
        b.graph.remove(list(reversed(b.created)))
    for value in b.constants:
        b.graph.remove_initializer(value)


def _read_since_found(m: Match) -> bool:
    """Whether something outside ``m`` now reads a value it would remove. The finder proved none
    did, but a rewrite applied before it this round may: a plan may read past its own pattern
    (attention-4d takes K from behind a K^T chain that another match collapses)."""
    inside = {id(n) for n in [*m.nodes, *m.feeders]}
    return any(_read_outside(value, inside) for value in _removed_outputs(m, [*m.feeders, *m.nodes]))


def _entry_gone(m: Match) -> bool:
    """Whether a value the match reads lost its producer to a rewrite applied before it this round: an exported
    entry another match stood for (ort-group-query-attention's KV cache Concat, read by a dead Q K^T MatMul that
    ort-fusedmatmul-mul matched). Built on, the rewrite would read a value no longer in the graph."""
    values = (v for v in m.bindings.values() if isinstance(v, Value))
    return any(v.producer is not None and v.producer.graph is None for v in values)


def _removed_outputs(m: Match, nodes: Iterable[Node]) -> Iterator[Value]:
    """The outputs of ``nodes`` that the rewrite removes: all but the root's and a one-output exported
    entry's, which the build stands for."""
    exported = {id(m.bindings.get(name)) for name in m.rule.exports}
    for node in nodes:
        if node is not m.root and not (id(node) in exported and len(node.outputs) == 1):
            yield from node.outputs


def _type_change(before: Value, after: Value) -> str | None:
    """How ``after`` differs from ``before`` in element type or shape, where both are known."""
    old_dtype, new_dtype = tensor_dtype(before), tensor_dtype(after)
    known = (DataType.UNDEFINED, None)
    if old_dtype not in known and new_dtype not in known and old_dtype != new_dtype:
        return f"the rewrite changes the element type from {old_dtype.name} to {new_dtype.name}"
    old, new = tensor_shape(before), tensor_shape(after)
    if old is None or new is None:
        return None
    differs = len(old) != len(new) or any(
        isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(old, new, strict=True)
    )
    return f"the rewrite changes the output from {_dims(old)} to {_dims(new)}" if differs else None


def _dims(shape: tuple[Any, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _read_outside(value: Value, inside: set[int]) -> bool:
    return value.is_graph_output or any(id(use.node) not in inside for use in value.uses())


def run_round(
    model: Model,
    rules: RuleSet,
    site_for: Callable[[Graph], Site],
    stats: RunStats,
    *,
    through_qdq: bool = True,
    withheld: frozenset[str] = frozenset(),
    only: RuleSet | None = None,
) -> int:
    """One round of ``rules`` over every graph of ``model``; the number of rewrites.

    In a graph with Q/DQ pairs the rules marked ``through_qdq`` (but those of the ``withheld``
    families) go first, with the pairs hidden (:mod:`graphopt.passes.rewrite.qdq`), then the
    others on the graph as it is; elsewhere, or when ``through_qdq`` is off, all together, as
    one rule set. ``only``: the rules of ``rules`` with anything to find, the round before having
    chosen no match (the others go again in a graph's second phase once its first changed it)."""
    applied = 0
    through, others = rules.through_qdq(withheld) if through_qdq else (RuleSet(), rules)
    for graph in list(model.all_graphs()):
        site = site_for(graph)
        remaining, tried = rules, only
        if through:
            with hidden(model, graph, site.ctx) as quantized:
                if quantized:
                    before = stats.applied.copy()
                    changed = _apply_round(graph, through.within(only), site, stats)
                    stats.through_qdq.update(stats.applied - before)
                    applied += changed
                    remaining, tried = others, None if changed else only
        applied += _apply_round(graph, remaining.within(tried), site, stats)
    return applied


def _apply_round(graph: Graph, rules: RuleSet, site: Site, stats: RunStats) -> int:
    applied = 0
    matches = find_matches(graph, rules, site, stats)
    stats.chosen += len(matches)
    for m in matches:
        if apply_match(m, site, stats):
            stats.applied[m.rule.name] += 1
            applied += 1
    return applied


def sweep(model: Model, rules: RuleSet, site_for: Callable[[Graph], Site], stats: RunStats) -> int:
    """Single-node ``rules`` over every graph of ``model`` in topological order, each applied as
    soon as it matches (so a chain of them goes in one sweep); the number of rewrites."""
    applied = 0
    for graph in list(model.all_graphs()):
        site = site_for(graph)
        for node in graph.topological():
            for _, rule in rules.rooted_at(node.op_type):
                if rule.retired(site) or stats.failed_at(rule, node):
                    continue
                found = _first_valid(rule, node, site, stats)
                if found is not None and apply_match(found, site, stats):
                    stats.applied[rule.name] += 1
                    applied += 1
                    break
    return applied


def _first_valid(rule: Rule[Any], root: Node, site: Site, stats: RunStats) -> Match | None:
    for m in _candidates(rule, root, site, stats):
        try:
            if _valid(m, site) is None:
                return m
        except RuleFailed as err:
            stats.fail(m.rule, m.root, err)
            return None
    return None
