"""Whole-model symbolic type inference, the work of the ``shape-infer`` pass.

It goes on where onnx's own inference stops. The driver walks each graph in topological
order (subgraph bodies with the outer values in view), asks the rule table (:mod:`rules`)
for each node's output types and the value table (:mod:`values`) for the symbolic values
of small int outputs, and records the result on ``value.type`` where that is unknown or
less precise.

Precedence, per dim:

1. a dim the model already declares stays (a graph output's ``batch`` is never renamed;
   an intermediate dim onnx once named ``unk__3`` is a placeholder and may be replaced, and
   a graph output's by a proven size);
2. else the dim our rules compute (ints, names, expressions such as ``seq + 1``);
3. else the dim onnx's own inference found, except its invented ``unk__N`` names. onnx
   runs over a light copy of the model (reached through the facts service's
   ``onnx_types``, which io provides) only when a rule leaves a value incomplete, once per
   structural state of the model; the copy already carries the types inferred so far.

Ops of onnxruntime's com.microsoft domain have rules of their own (:mod:`contrib`). An op
without a rule (or from another domain) keeps whatever its outputs declare, and
inference continues downstream from what is known. Following the tracing seed, a
loop-carried dim that changes between iterations becomes unknown; with
``independent_dims`` each carried dim enters the body as a fresh variable, so two carried
``batch`` dims are not assumed equal inside it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from graphopt.facts.contrib import type_rule
from graphopt.facts.op import Op, norm_axis
from graphopt.facts.service import Facts
from graphopt.facts.values import VALUE_RULES
from graphopt.ir import DataType, Dim, Expr, Graph, Model, Node, Sym, TensorType, Type, Value

__all__ = ["InferenceSummary", "fully_known", "infer_model"]

logger = logging.getLogger(__name__)

_REPORTED_UNKNOWN = 20
# Rounds of "infer the body, generalize the carried types" before a loop body settles.
_MAX_BODY_ROUNDS = 3


@dataclass
class InferenceSummary:
    """What a whole-model inference found, for the pass's report details."""

    changed: bool
    details: dict[str, Any]


def infer_model(facts: Facts, *, use_onnx: bool = True, onnx_max_nodes: int = 50_000) -> InferenceSummary:
    """Type every value of ``facts.model`` it can, recording symbolic values in ``facts``."""
    model = facts.model
    before = _census(model)
    n_nodes = sum(1 for _ in model.graph.all_nodes())
    inference = _Inference(facts, use_onnx=use_onnx and n_nodes <= onnx_max_nodes)
    inference.changed = _ranks_through_identities(model)
    inference.graph(model.graph)
    after = _census(model)
    details: dict[str, Any] = {
        "values": after.total,
        "typed_before": before.typed,
        "typed_after": after.typed,
        "fully_known_before": before.complete,
        "fully_known_after": after.complete,
        "symbolic_dims": after.symbolic_dims,
        "onnx_seeded": len(inference.seeds or {}),
        "unknown_count": len(after.unknown),
        "unknown": after.unknown[:_REPORTED_UNKNOWN],
    }
    if inference.failures:
        details["rule_failures"] = inference.failures[:_REPORTED_UNKNOWN]
    return InferenceSummary(inference.changed, details)


class _Inference:
    def __init__(self, facts: Facts, *, use_onnx: bool) -> None:
        model = facts.model
        self.facts = facts
        self.model = model
        self.use_onnx = use_onnx
        # onnx's types, fetched on the first value our rules leave incomplete: onnx's
        # inference costs a copy and a serialization of the model, and on most models
        # the rules type every value on their own.
        self.seeds: dict[int, Type] | None = None
        self.unseeded: set[int] = set()
        self.independent_dims = facts.independent_dims
        self.changed = False
        self.failures: list[str] = []
        declared = [v.type for v in [*model.graph.inputs, *model.graph.outputs]]
        self.declared_names = {s.name for t in declared for s in _syms_of(t)}
        all_syms = [s for g in model.all_graphs() for v in g.values() for s in _syms_of(v.type)]
        self.uids = itertools.count(max((s.uid for s in all_syms), default=0) + 1)

    # -- traversal ----------------------------------------------------------------------
    def graph(self, graph: Graph) -> None:
        for node in graph.topological():
            self.node(node)

    def node(self, node: Node) -> None:
        if node.opaque:  # no schema at this opset: its outputs keep their declared types
            return
        op = self.facts.op(node)
        inferred: list[TensorType | None] = []
        control_flow = node.op_type if node.in_standard_domain else None
        if control_flow == "If":
            inferred = self.if_(node)
        elif control_flow == "Loop":
            inferred = self.loop(op)
        elif control_flow == "Scan" and op.opset >= 9:
            inferred = self.scan(op)
        else:
            for body in node.subgraphs():
                self.graph(body)
            rule = type_rule(node)
            if rule is not None:
                inferred = self.apply(node, lambda: rule(op), [])
        for index, value in enumerate(node.outputs):
            self.assign(value, inferred[index] if index < len(inferred) else None)
        value_rule = VALUE_RULES.get(node.op_type) if node.in_standard_domain else None
        if value_rule is not None:
            found = self.apply(node, lambda: value_rule(op), [])
            for value, symbolic in zip(node.outputs, found, strict=False):
                self.facts.record(value, symbolic)

    def apply(self, node: Node, fn: Any, fallback: Any) -> Any:
        # A malformed node (axis out of range, wrong arity, an attribute of another kind, a
        # repeated axis that exhausts an iterator) must not stop inference of the rest.
        try:
            return fn()
        except (ArithmeticError, AttributeError, LookupError, RuntimeError, TypeError, ValueError) as err:
            self.failures.append(f"{node.op_type} {node.name!r}: {type(err).__name__}: {err}")
            logger.debug("shape rule for %s %r failed: %s", node.op_type, node.name, err)
            return fallback

    # -- recording types ----------------------------------------------------------------
    def assign(self, value: Value, inferred: Type | None) -> None:
        best = inferred if fully_known(inferred) else _fill(inferred, self.seed(value))
        merged = _merge(value.type, best, user_facing=value.is_graph_output or value.is_graph_input)
        if merged != value.type:
            value.type = merged
            self.changed = True

    def seed(self, value: Value) -> Type | None:
        """onnx's type for ``value``, without the names onnx made up."""
        if not self.use_onnx or id(value) in self.unseeded:
            return None
        if self.seeds is None:
            self.seeds = dict(self.facts.onnx_seeds())
        found = self.seeds.get(id(value))
        if not isinstance(found, TensorType) or found.shape is None:
            return found

        def keep(dim: Dim) -> Dim:
            if isinstance(dim, (Sym, Expr)) and (
                self.independent_dims or any(s.name not in self.declared_names for s in _syms_of_dim(dim))
            ):
                return None
            return dim

        return replace(found, shape=tuple(keep(d) for d in found.shape))

    # -- control flow -------------------------------------------------------------------
    def if_(self, node: Node) -> list[TensorType | None]:
        branches = [node.attr("then_branch"), node.attr("else_branch")]
        for branch in branches:
            if isinstance(branch, Graph):
                self.graph(branch)
        if not all(isinstance(b, Graph) for b in branches):
            return []
        then_out, else_out = branches[0].outputs, branches[1].outputs
        return [_join(a.type, b.type) for a, b in zip(then_out, else_out, strict=False)]

    def loop(self, op: Op) -> list[TensorType | None]:
        """Loop(M, cond, v...) with body(i, cond, v...) -> (cond, v..., scan outputs...)."""
        body = op.attr("body")
        if not isinstance(body, Graph):
            return []
        carried = [self.entry_type(op.type(i)) for i in range(2, op.n_inputs)]
        entry: list[TensorType | None] = [TensorType(DataType.INT64, ()), TensorType(DataType.BOOL, ()), *carried]
        carried_out = self.settle(body, entry, first_carried=2, first_result=1, n_carried=len(carried))
        trip: Dim = None
        if op.input(1) is None:
            count = op.sym(0)
            trip = count[0] if count is not None and len(count) == 1 else None
        scans = [_stacked(v.type, trip, 0) for v in body.outputs[1 + len(carried) :]]
        return [*carried_out, *scans]

    def scan(self, op: Op) -> list[TensorType | None]:
        """Scan(states..., inputs...) with body(states..., slices...) -> (states..., per-step outputs...)."""
        body = op.attr("body")
        if not isinstance(body, Graph):
            return []
        n_scan = op.attr("num_scan_inputs", 0)
        n_states = op.n_inputs - n_scan
        input_axes = op.attr("scan_input_axes") or [0] * n_scan
        states = [self.entry_type(op.type(i)) for i in range(n_states)]
        slices: list[TensorType | None] = []
        length: Dim = None
        for j in range(n_scan):
            kind = op.type(n_states + j)
            if kind is None or kind.shape is None:
                slices.append(None if kind is None else kind)
                continue
            axis = norm_axis(input_axes[j], len(kind.shape))
            if axis is None:
                slices.append(TensorType(kind.dtype))
                continue
            length = length if length is not None else kind.shape[axis]
            slices.append(TensorType(kind.dtype, kind.shape[:axis] + kind.shape[axis + 1 :]))
        states_out = self.settle(body, [*states, *slices], first_carried=0, first_result=0, n_carried=n_states)
        per_step = body.outputs[n_states:]
        output_axes = op.attr("scan_output_axes") or [0] * len(per_step)
        return [*states_out, *(_stacked(v.type, length, a) for v, a in zip(per_step, output_axes, strict=False))]

    def entry_type(self, kind: TensorType | None) -> TensorType | None:
        """A carried value's type as the body sees it (fresh dims under ``independent_dims``)."""
        if kind is None or kind.shape is None or not self.independent_dims:
            return kind
        return replace(kind, shape=tuple(self.fresh(d) for d in kind.shape))

    def fresh(self, dim: Dim) -> Dim:
        return Sym(dim.name, next(self.uids)) if isinstance(dim, Sym) else dim

    def settle(
        self, body: Graph, entry: list[TensorType | None], *, first_carried: int, first_result: int, n_carried: int
    ) -> list[TensorType | None]:
        """Infer ``body``, widening carried dims that change per iteration until they hold.

        Returns the carried values' types after the loop.
        """
        snapshot = {v: v.type for v in _body_values(body)}
        for value in snapshot:
            # onnx types a body from the entry types alone, too narrow for a dim that changes.
            self.unseeded.add(id(value))
        carried_in = body.inputs[first_carried : first_carried + n_carried]
        carried_out = body.outputs[first_result : first_result + n_carried]
        for round_number in range(_MAX_BODY_ROUNDS):
            for value, kind in zip(body.inputs, entry, strict=False):
                self.assign(value, kind)
            self.graph(body)
            widened: list[TensorType | None] = [
                _join(a.type, b.type) for a, b in zip(carried_in, carried_out, strict=False)
            ]
            if widened == [v.type for v in carried_in] or round_number == _MAX_BODY_ROUNDS - 1:
                return widened
            # Types inferred from too narrow an entry are wrong, not merely imprecise: start over.
            for value, original in snapshot.items():
                value.type = original
                self.facts.forget(value)
            entry = [*entry[:first_carried], *widened, *entry[first_carried + n_carried :]]
        return []


# -- merging -------------------------------------------------------------------------------


def _ranks_through_identities(model: Model) -> bool:
    """Give a value of unknown rank the rank (and int dims) an Identity of it declares.

    An Identity's output is its input, so the type the model declares for the output is the
    input's. TorchScript exports rely on it: ``x.squeeze(-1)`` becomes an If whose branches
    differ in rank, so the If's output has none, and the LSTMCell after it tests
    ``input.dim() != 2`` in Ifs whose not-taken branch returns ``Identity(input)`` declared
    ``[?, 128]``: that declaration decides every one of those Ifs. Names of dims are not
    carried over (the exporter's are placeholders); inference fills them in.
    """
    changed = False
    for graph in [model.graph, *model.graph.subgraphs()]:  # function bodies declare no types
        for node in graph:
            if node.op_type != "Identity" or not node.in_standard_domain or node.opaque:
                continue
            source, declared = node.input(0), node.outputs[0].type
            if source is None or not isinstance(declared, TensorType) or declared.shape is None:
                continue
            kind = source.type
            if kind is None or (isinstance(kind, TensorType) and kind.shape is None and kind.dtype == declared.dtype):
                source.type = TensorType(
                    declared.dtype, tuple(d if isinstance(d, int) else None for d in declared.shape)
                )
                changed = True
    return changed


def _fill(mine: Type | None, onnx: Type | None) -> Type | None:
    """Our type, with dims we could not compute taken from onnx's."""
    if mine is None:
        return onnx
    if not isinstance(mine, TensorType) or not isinstance(onnx, TensorType) or mine.dtype != onnx.dtype:
        return mine
    if mine.shape is None:
        return replace(mine, shape=onnx.shape)
    if onnx.shape is None or len(onnx.shape) != len(mine.shape):
        return mine
    return replace(mine, shape=tuple(m if m is not None else o for m, o in zip(mine.shape, onnx.shape, strict=False)))


def fully_known(kind: Type | None) -> bool:
    """A tensor type with every dim known (an int or a name): onnx could add nothing to it."""
    return isinstance(kind, TensorType) and kind.shape is not None and all(d is not None for d in kind.shape)


def _placeholder(dim: Dim) -> bool:
    return isinstance(dim, Sym) and dim.name.startswith("unk__")


def _merge(declared: Type | None, inferred: Type | None, *, user_facing: bool) -> Type | None:
    """The declared type, with its unknown parts filled in from the inferred one."""
    if inferred is None:
        return declared
    if declared is None:
        return inferred
    if not isinstance(declared, TensorType) or not isinstance(inferred, TensorType):
        return declared
    if declared.dtype != inferred.dtype:
        return declared
    if declared.shape is None:
        return replace(declared, shape=inferred.shape)
    if inferred.shape is None or len(inferred.shape) != len(declared.shape):
        return declared

    def pick(mine: Dim, theirs: Dim) -> Dim:
        # An interior value's placeholder gives way to any dim found. A graph output's gives way to a proven size
        # only, never to a name (its declared names are the user's): converters that run onnx's shape inference
        # write unk__N on every output, and a rule proving a head count at the Reshape that writes the output
        # needs the size.
        if theirs is None or (
            mine is not None and not (_placeholder(mine) and (not user_facing or isinstance(theirs, int)))
        ):
            return mine
        return theirs

    return replace(declared, shape=tuple(pick(d, i) for d, i in zip(declared.shape, inferred.shape, strict=False)))


def _join(a: Type | None, b: Type | None) -> TensorType | None:
    """What two types (branches of an If, a loop's entry and exit) have in common."""
    if not isinstance(a, TensorType) or not isinstance(b, TensorType) or a.dtype != b.dtype:
        return None
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return TensorType(a.dtype)
    return TensorType(a.dtype, tuple(x if x == y else None for x, y in zip(a.shape, b.shape, strict=False)))


def _stacked(kind: Type | None, length: Dim, axis: int) -> TensorType | None:
    """A per-iteration type stacked along ``axis`` over ``length`` iterations."""
    if not isinstance(kind, TensorType):
        return None
    if kind.shape is None:
        return TensorType(kind.dtype)
    index = norm_axis(axis, len(kind.shape) + 1)
    if index is None:
        return TensorType(kind.dtype)
    return TensorType(kind.dtype, (*kind.shape[:index], length, *kind.shape[index:]))


def _body_values(body: Graph) -> Iterator[Value]:
    for graph in [body, *body.subgraphs()]:
        yield from graph.values()


def _syms_of_dim(dim: Dim) -> set[Sym]:
    if isinstance(dim, Sym):
        return {dim}
    if isinstance(dim, Expr):
        return dim.symbols()
    return set()


def _syms_of(kind: Type | None) -> Iterable[Sym]:
    if isinstance(kind, TensorType) and kind.shape is not None:
        for dim in kind.shape:
            yield from _syms_of_dim(dim)


# -- the report ----------------------------------------------------------------------------


@dataclass
class _Census:
    total: int = 0
    typed: int = 0
    complete: int = 0
    symbolic_dims: int = 0
    unknown: list[str] = field(default_factory=list)


def _census(model: Model) -> _Census:
    """How many node outputs have a type (a known rank) and how many have every dim known.

    Function bodies are left out: their inputs have no types until a call site is inlined.
    """
    census = _Census()
    for node in model.graph.all_nodes():
        for value in node.outputs:
            census.total += 1
            kind = value.type
            if kind is None or (isinstance(kind, TensorType) and kind.shape is None):
                census.unknown.append(value.name)
                continue
            census.typed += 1
            shape = kind.shape if isinstance(kind, TensorType) else ()
            census.complete += all(d is not None for d in shape or ())
            census.symbolic_dims += sum(isinstance(d, (Sym, Expr)) for d in shape or ())
    return census
