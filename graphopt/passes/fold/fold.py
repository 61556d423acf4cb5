"""The ``fold`` pass: same-level siblings become one op, located through a fold index.

    levels (constant producers ignored) -> groups by fold key -> build_folded_graph
      -> chains of folds (a fold and the folds that read its tensor as it is)
      -> the cost model accepts or refuses each chain -> realize, slice, remove

The report's details hold the fold index: every output of a folded node, by name, mapped
to its fold and slice, and per fold the tensor that holds the slices and their layout; the
other outputs keep their names. Refused chains are listed with the predicted gain.
Every graph is folded on its own: the main graph, the bodies of If / Loop / Scan nodes and
function bodies (where their values are typed); a fold never spans two graphs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.facts import infer_model
from graphopt.ir import Graph, Model, Node, Value
from graphopt.ir.constness import constant_array, is_constant
from graphopt.ir.ops import ELEMENTWISE_BINARY, ELEMENTWISE_UNARY
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.fold.costs import BATCHES, LEVELS, chain_terms, chain_time_us, gains_us
from graphopt.passes.fold.index import Fold, FoldIndex, build_folded_graph
from graphopt.passes.fold.plan import SEED_OPS, Planner, Spec
from graphopt.passes.fold.realize import Realizer, remove_folded

__all__ = ["ChainPrediction", "FoldSiblings", "predict_chains"]

FOLDABLE_OPS = sorted(SEED_OPS | ELEMENTWISE_UNARY | ELEMENTWISE_BINARY)


@dataclass
class FoldOptions:
    min_group: int = option(2, "Fold only groups of at least this many sibling ops (fold pass).")
    ops: list[str] = option(
        [], "Op types the fold pass may fold (default: every op it can; `graphopt passes` lists them)."
    )
    tolerance: float = option(
        0.0,
        "Take a fold whose predicted cost is within this fraction of the time of the kernels it "
        "replaces (for the nodes it removes); by default a fold predicted to cost anything is refused.",
    )
    force: bool = option(
        False, "Take every fold, also those the fold cost model predicts to be slower (to measure them)."
    )


@register
class FoldSiblings(Pass, name="fold", options=FoldOptions):
    # The description lists the foldable ops, so it is no docstring.
    description = (
        "Fold same-level sibling MatMul / Gemm / Conv (and the element-wise ops after them) into one op; "
        f"foldable ops (--fold-ops): {', '.join(FOLDABLE_OPS)}"
    )

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        options: FoldOptions = self.options
        ops = set(options.ops or FOLDABLE_OPS)
        if ops - set(FOLDABLE_OPS):
            unknown = ", ".join(sorted(ops - set(FOLDABLE_OPS)))
            raise ValueError(f"--fold-ops: cannot fold {unknown}; foldable: {', '.join(FOLDABLE_OPS)}")
        typed = _ensure_types(model, ctx)
        details: dict[str, Any] = {"folds": [], "index": {}, "refused": []}
        if typed:
            details["typed_first"] = True
        changed = False
        for graph in list(model.all_graphs()):
            changed |= self._fold_graph(model, graph, ctx, frozenset(ops), details)
        return PassResult(changed, details)

    def _fold_graph(
        self, model: Model, graph: Graph, ctx: PassContext, ops: frozenset[str], details: dict[str, Any]
    ) -> bool:
        """Fold one graph (the main graph, a body, a function); its folds are numbered after
        those already in ``details``."""
        options: FoldOptions = self.options
        constants = _constant_values(graph)

        def constant(value: Value | None) -> bool:
            return value is not None and (id(value) in constants or is_constant(value))

        weights = _Weights(model, graph, ctx, constant)
        planner = Planner(constant, weights.read, ops, max(2, options.min_group))
        index = build_folded_graph(graph.levels(ignore_constants=True), planner)
        accepted, refused = _judge(index, force=options.force, tolerance=options.tolerance)
        details["refused"].extend(refused)
        if not accepted:
            return False
        realizer = Realizer(model, graph, ctx, index, weights.read, self.name)
        folds = [f for f in index.folds if f.id in accepted]
        names = {f.id: [m.outputs[0].name for m in f.members] for f in folds}
        for fold in folds:
            realizer.realize(fold)
        for fold in folds:
            if _read_outside(fold, index, accepted):
                realizer.materialize(fold)
        remove_folded(graph, [m for f in folds for m in f.members], constant)
        first = len(details["folds"])
        for fold in folds:
            described = _describe(fold, names[fold.id], realizer.tensors[fold.id], accepted[fold.id], first)
            details["folds"].append({**described, "graph": graph.name})
            for position, name in enumerate(names[fold.id]):
                details["index"][name] = [first + fold.id, position]
        return True


def _ensure_types(model: Model, ctx: PassContext) -> bool:
    """Fold keys compare shapes: type the model first when a node output (of the main graph
    or a body in it) has no type."""
    if all(v.type is not None for n in model.graph.all_nodes() for v in n.outputs if v.name):
        return False
    infer_model(ctx.facts(model))
    return True


def _constant_values(graph: Graph) -> set[int]:
    """Outputs of the nodes that compute from constants only (left out of the levels)."""
    leveled = {id(n) for level in graph.levels(ignore_constants=True) for n in level}
    return {id(v) for n in graph.topological() if id(n) not in leveled for v in n.outputs}


class _Weights:
    """Reads a constant's array: an initializer or Constant directly, a computed one (a
    Transpose of a weight, a Cast of float16 weights) through the evaluator."""

    def __init__(self, model: Model, graph: Graph, ctx: PassContext, constant: Any) -> None:
        self.model = model
        self.graph = graph
        self.ctx = ctx
        self.constant = constant
        self._memo: dict[int, np.ndarray | None] = {}

    def read(self, value: Value | None) -> np.ndarray | None:
        if value is None:
            return None
        if id(value) not in self._memo:
            self._memo[id(value)] = self._compute(value)
        return self._memo[id(value)]

    def _compute(self, value: Value) -> np.ndarray | None:
        direct = constant_array(value, sys.maxsize)
        if direct is not None or not self.constant(value) or self.ctx.evaluator is None:
            return direct
        region: dict[int, Node] = {}
        pending = [value]
        while pending:
            producer = pending.pop().producer
            if producer is None or id(producer) in region or is_constant(producer.outputs[0]):
                continue
            region[id(producer)] = producer
            pending.extend(v for v in producer.inputs if v is not None)
        order = [n for n in self.graph.topological() if id(n) in region]
        opsets = self.model.opsets_of(self.graph)
        if not all(self.ctx.evaluator.can_evaluate(n, opsets) for n in order):
            return None
        try:
            return self.ctx.evaluator.evaluate(order, {}, [value], opsets)[value]
        except Exception:  # an evaluator refusal (budget, unsupported) only means "not a weight"
            return None


def _chains(index: FoldIndex[Spec]) -> list[list[Fold[Spec]]]:
    """Folds joined when one reads the other's tensor as it is (direct or through a Gather)."""
    parent = list(range(len(index.folds)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for fold in index.folds:
        source = fold.spec.operand.source
        if source is not None:
            parent[root(fold.id)] = root(source)
    chains: dict[int, list[Fold[Spec]]] = {}
    for fold in index.folds:
        chains.setdefault(root(fold.id), []).append(fold)
    return list(chains.values())


@dataclass
class ChainPrediction:
    """A chain of folds and what the cost model predicts of it at ``batch``, per level:
    ``gains`` (us saved, negative: it costs), ``kernels`` (us of its kernels unfolded) and
    ``terms`` (us of kernels saved, us of copies spent, before costs.CALIBRATION scales them)."""

    chain: list[Fold[Spec]]
    gains: dict[str, float]
    kernels: dict[str, float]
    terms: dict[str, tuple[float, float]]
    batch: int


def predict_chains(index: FoldIndex[Spec]) -> list[list[ChainPrediction]]:
    """The cost model's predictions for each chain of ``index``, one per batch of costs.BATCHES."""
    predictions = []
    for chain in _chains(index):
        ids = {f.id for f in chain}
        priced = []
        for batch in BATCHES:
            terms = chain_terms(chain, lambda f, ids=ids: _read_outside(f, index, ids), batch)  # type: ignore[misc]
            priced.append(ChainPrediction(chain, gains_us(terms), chain_time_us(chain, batch), terms, batch))
        predictions.append(priced)
    return predictions


def _judge(
    index: FoldIndex[Spec], *, force: bool, tolerance: float
) -> tuple[dict[int, dict[str, float]], list[dict[str, Any]]]:
    """Accept the chains the cost model says do not cost at any optimization level and batch
    (all with ``force``), and those whose predicted cost is within ``tolerance`` of the time
    of the kernels they replace. The default tolerance is 0: the Q/K/V folds of bert_small
    (predicted before costs.CALIBRATION -6 us of 220 us a layer), bert_fp16_weights and
    vit_ts (-21 us of 671 us), once taken for the nodes they remove, measured 1.5 to 3.5%
    slower end to end (100 interleaved rounds). An accepted chain reports its smallest
    predicted gain over the batches; a refused one its prediction at the first batch where
    it costs."""
    accepted: dict[int, dict[str, float]] = {}
    refused: list[dict[str, Any]] = []
    for priced in predict_chains(index):
        gains = [{level: round(p.gains[level], 2) for level in LEVELS} for p in priced]
        losing = [
            (p, level, gain[level])
            for p, gain in zip(priced, gains, strict=True)
            for level in LEVELS
            if gain[level] <= -tolerance * p.kernels[level]
        ]
        if force or not losing:
            smallest = {level: min(gain[level] for gain in gains) for level in LEVELS}
            accepted.update({f.id: smallest for f in priced[0].chain})
            continue
        predicted, level, _ = losing[0]
        refused.append(
            {
                "members": [[m.name or m.outputs[0].name for m in f.members] for f in predicted.chain],
                "ops": sorted({f.members[0].op_type for f in predicted.chain}),
                "reason": _refusal(predicted, level),
                "predicted_gain_us": gains[priced.index(predicted)],
                "kernels_us": {level: round(predicted.kernels[level], 2) for level in LEVELS},
                "batch": predicted.batch,
            }
        )
    return accepted, refused


def _refusal(predicted: ChainPrediction, level: str) -> str:
    """Why a chain costs at ``level``: its folded kernels themselves, or the copies they need;
    and the batch, when it pays at a smaller one."""
    saved, _ = predicted.terms[level]
    why = (
        "the folded kernels cost more than the kernels they replace"
        if saved < 0
        else "the copies it needs cost more than the kernels it saves"
    )
    return why if predicted.batch == BATCHES[0] else f"{why} at batch {predicted.batch}"


def _read_outside(fold: Fold[Spec], index: FoldIndex[Spec], chain: Any) -> bool:
    """Whether a member's output is read by anything but a fold of the chain that reads the
    fold's tensor (or is a graph output): then the fold needs its slices cut out."""
    readers: set[int] = set()
    for other in index.folds:
        if other.id in chain and other.spec.operand.source == fold.id:
            readers.update(id(m) for m in other.members)
    for member in fold.members:
        output = member.outputs[0]
        if output.is_graph_output or any(id(u.node) not in readers for u in output.uses()):
            return True
    return False


def _describe(fold: Fold[Spec], names: list[str], tensor: Value, gains: dict[str, float], first: int) -> dict[str, Any]:
    """``fold`` for the report, its id and those of the folds it reads counted from ``first``."""
    layout = fold.spec.layout
    return {
        "id": first + fold.id,
        "how": fold.spec.how,
        "op": fold.members[0].op_type,
        "members": names,
        "tensor": tensor.name,
        "layout": layout.kind,
        "axis": layout.axis,
        "ranges": [list(r) for r in layout.ranges],
        "reads": fold.spec.operand.how,
        "inputs": [[None if s is None else [first + s.fold, s.slice] for s in member] for member in fold.inputs],
        "predicted_gain_us": gains,
    }
