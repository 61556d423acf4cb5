"""Remove operations that return their input unchanged: the ``noop`` pass.

Its rules are the noop family (graphopt/passes/cleanup/rules.py), single-node rules the
rewrite engine sweeps over every graph in topological order, so chains such as
``Identity(Identity(x))`` go in one sweep.
"""

from __future__ import annotations

from graphopt.ir import Graph, Model
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.cleanup.rules import RULES
from graphopt.passes.rewrite.engine import RuleSet, RunStats, Site, sweep

__all__ = ["NoopElimination"]

_RULES = RuleSet(RULES)


@register
class NoopElimination(Pass, name="noop"):
    """Remove operations that return their input unchanged (Identity, Dropout, Cast to its own type, ...)"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        stats = RunStats()

        def site_for(graph: Graph) -> Site:
            return Site(model, graph, model.opset_in(graph), ctx.settings.target, ctx)

        sweep(model, _RULES, site_for, stats)
        return PassResult(bool(stats.applied), {"removed": dict(sorted(stats.applied.items()))}, stats.failures)
