"""The ``const-cache`` pass (briefs/constcache.md): one run does, in order,

1. Constant nodes -> initializers;
2. symbolic shape folding (:mod:`.symbolic`): static plumbing values become constants,
   Reshape / Expand / Tile targets become constants with 0, -1 or 1 for the dynamic dims;
3. constness (:mod:`.lattice`), then postponing expanding ops (:mod:`.postpone`);
4. folding of COMPILE_CONST regions under the size guards (:mod:`.folding`); when a fold
   fed a node of an incomplete type, the model is typed again and steps 2-4 repeat (the
   shape plumbing of TensorFlow "same" padding folds conv after conv this way);
5. If nodes decided (a constant condition, or branches that compute the same), Loops of no
   or one iteration and Scans of one inlined (:mod:`.controlflow`); equal initializers
   stored once;
6. with runtime constants, the runtime_fold split (:mod:`.runtime`).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from graphopt.facts import infer_model
from graphopt.ir import Graph, Model, Node
from graphopt.ir.rewrite import Builder
from graphopt.ir.stats import model_stats
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.constcache.constants import constants_to_initializers, deduplicate_initializers
from graphopt.passes.constcache.controlflow import inline_decided_control_flow
from graphopt.passes.constcache.fold_once import split_runtime
from graphopt.passes.constcache.folding import Guards, RegionFolder
from graphopt.passes.constcache.lattice import Lattice, Rules, analyze
from graphopt.passes.constcache.postpone import postpone_expansions
from graphopt.passes.constcache.symbolic import fold_symbolic

__all__ = ["ConstCache", "ConstCacheOptions"]


@dataclass
class ConstCacheOptions:
    const_input: list[str] = option(
        [],
        "Graph inputs (names or globs) a server feeds once per model, such as weights: "
        "runtime constants that the const-cache pass folds into runtime_fold",
        knob="const_input",
    )
    fold_qdq: bool = option(
        False, "Let constant folding evaluate QuantizeLinear / DequantizeLinear of weights.", knob="fold_qdq"
    )
    defer_growth: bool = option(
        False,
        "Fold what would grow the file (float16 -> float32 weight Casts, weight "
        "DequantizeLinear, tied weight Transposes) once per process in runtime_fold instead.",
        knob="defer_growth",
    )
    max_growth_bytes: int = option(
        64 << 10,
        "most bytes one folded region may add to the file (new tensors minus the ones that die); "
        "the default keeps float16 weights from being stored again as float32",
    )
    max_tensor_bytes: int = option(256 << 20, "largest tensor a fold may create")
    max_model_growth: float = option(
        0.1, "most the folds may grow the model's stored bytes, as a fraction (at least max_growth_bytes)"
    )


@register
class ConstCache(Pass, name="const-cache", options=ConstCacheOptions):
    """Fold constant regions under size guards, fold shape plumbing symbolically, inline decided If and
    one-iteration Loop / Scan nodes, cache runtime constants"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        names = ctx.names(model)
        details: dict[str, Any] = {}
        details["constants_to_initializers"] = constants_to_initializers(model, names)
        make = _Make(model, ctx, self.name)
        details["control_flow"] = inline_decided_control_flow(model, make)
        details["symbolic"] = {}
        symbolic: Counter[str] = Counter()
        rounds = 0
        while True:
            symbolic += fold_symbolic(model, ctx.facts(model), make)
            if ctx.evaluator is None:
                break
            folder, lattice = self._fold(model, ctx, make, details)
            # A fold that fed a node of an incomplete type may have made it known (the size
            # a Pad writes once its pads are constant): the plumbing reading it can fold next.
            if not (folder.retype and infer_model(ctx.facts(model), use_onnx=False).changed):
                break
            rounds += 1
        details["symbolic"] = dict(sorted(symbolic.items()))
        if rounds:
            details["retyped_rounds"] = rounds
        options: ConstCacheOptions = self.options
        if ctx.evaluator is not None and (options.const_input or options.defer_growth):
            deferred = folder.grew if options.defer_growth else []
            details["runtime_fold"] = split_runtime(model, lattice, deferred, names)
        details["deduplicated"] = deduplicate_initializers(model, names)
        changed = any(
            details[k] for k in ("constants_to_initializers", "control_flow", "deduplicated", "symbolic")
        ) or bool(details.get("folded", {}).get("nodes"))
        return PassResult(changed, details)

    def _fold(
        self, model: Model, ctx: PassContext, make: _Make, details: dict[str, Any]
    ) -> tuple[RegionFolder, Lattice]:
        """One round of postponing and folding; its figures added to ``details``."""
        assert ctx.evaluator is not None
        options: ConstCacheOptions = self.options
        rules = Rules(options.const_input, options.fold_qdq, options.defer_growth, ctx.evaluator)
        stored = model_stats(model).initializer_bytes
        # The stored bytes when the run's first const-cache step saw the model: one budget per run.
        baseline = ctx.state(model, "const-cache.baseline", lambda: stored)
        # A small model may still grow by one region's worth.
        allowed = max(int(baseline * options.max_model_growth), options.max_growth_bytes)
        budget = baseline + allowed - stored
        guards = Guards(options.max_growth_bytes, options.max_tensor_bytes, budget)
        folder = RegionFolder(ctx.evaluator, guards, ctx.names(model), ctx.facts(model).infer_node)
        lattice = analyze(model, rules)
        graphs = [model.graph, *model.graph.subgraphs()]
        postponed: Counter[str] = Counter(details.get("postponed", {}))
        for graph in graphs:
            postponed += postpone_expansions(graph, lattice, functools.partial(make, graph))
        details["postponed"] = dict(sorted(postponed.items()))
        for graph in graphs:
            if _attached(graph, model):
                folder.graph(graph, lattice, model.opsets_of(graph))
        folded = details.get("folded", {"regions": 0, "nodes": 0})
        details["folded"] = {
            "regions": folded["regions"] + folder.folded_regions,
            "nodes": folded["nodes"] + folder.folded_nodes,
        }
        # The last round's refusals: a region refused before a retyping may fold after it.
        details["refused"] = folder.refused
        inlined = Counter(details["control_flow"]) + Counter(inline_decided_control_flow(model, make))
        details["control_flow"] = dict(sorted(inlined.items()))
        return folder, lattice


def _attached(graph: Graph, model: Model) -> bool:
    """Whether ``graph`` is still part of the model (an earlier fold may have removed its owner)."""
    while graph.parent is not None:
        if graph.parent.graph is None:
            return False
        graph = graph.parent.graph
    return graph is model.graph


class _Make:
    """Builders from the pass context: fresh names, typed outputs, the pass's provenance tag."""

    def __init__(self, model: Model, ctx: PassContext, tag: str) -> None:
        self.model = model
        self.ctx = ctx
        self.tag = tag
        self.names = ctx.names(model)

    def __call__(self, graph: Graph, before: Node | None) -> Builder:
        return self.ctx.builder(self.model, graph, before=before, tag=self.tag)
