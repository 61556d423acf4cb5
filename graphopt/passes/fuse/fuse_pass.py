"""The ``fuse`` pass: shatter rules, then fuse rules, round after round (engine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphopt.errors import InputError
from graphopt.ir import Graph, Model
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.fuse.engine import RunStats, Site, run_round, select_rules
from graphopt.passes.fuse.rules.lower import FAMILY as LOWERING

__all__ = ["Fuse"]

# onnxruntime's contrib ops (target ort) need their domain imported.
CONTRIB_DOMAIN = "com.microsoft"


@dataclass
class FuseOptions:
    max_steps: int = field(default=5, metadata={"help": "Most rounds of shatter then fuse rules per run."})
    enable: list[str] = field(
        default_factory=list, metadata={"help": "Rules or families to run that are off by default."}
    )
    disable: list[str] = field(default_factory=list, metadata={"help": "Rules or families not to run."})


@register
class Fuse(Pass, name="fuse", options=FuseOptions):
    """Fuse op patterns into fused ops (LayerNorm, GELU, attention, Conv+BN, ...) and shatter what hides folding"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        options: FuseOptions = self.options
        target = ctx.settings.target
        opset_before = model.opset
        goal = ctx.settings.target_opset or model.opset
        if goal > model.opset:
            ctx.convert_opset(model, goal)  # upgrade first, so the newer fused ops become available
        rules = select_rules(options.enable, options.disable, target)
        shatter = [r for r in rules if r.kind == "shatter"]
        fuse = [r for r in rules if r.kind == "fuse"]
        stats = RunStats()

        def site_for(graph: Graph) -> Site:
            return Site(model, graph, min(model.opset_in(graph), goal), target, ctx)

        rounds = 0
        for _ in range(options.max_steps):
            rounds += 1
            if run_round(model, shatter, site_for, stats) + run_round(model, fuse, site_for, stats) == 0:
                break
        if CONTRIB_DOMAIN not in model.opset_imports and any(n.domain == CONTRIB_DOMAIN for n in model.all_nodes()):
            model.opset_imports[CONTRIB_DOMAIN] = 1
        if goal < model.opset:
            try:
                ctx.convert_opset(model, goal)  # after the shatter rules lowered the ops the goal lacks
            except InputError as err:
                why = stats.near_misses.get(LOWERING, [])  # the op that blocks it, and why it stayed
                raise InputError(f"{err}; not lowered: {'; '.join(why[:3])}" if why else str(err)) from None
        changed = bool(stats.applied) or model.opset != opset_before
        details = {"target": target, "opset": [opset_before, model.opset], "rounds": rounds, **stats.as_dict()}
        return PassResult(changed, details)
