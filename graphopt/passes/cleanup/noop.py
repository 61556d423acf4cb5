"""Remove operations that return their input unchanged: the ``noop`` pass.

Its rules are the noop family (graphopt/passes/fuse/rules/noop.py), single-node rules the
rewrite engine sweeps over every graph in topological order, so chains such as
``Identity(Identity(x))`` go in one sweep.
"""

from __future__ import annotations

from graphopt.ir import Graph, Model
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["NoopElimination"]


@register
class NoopElimination(Pass, name="noop"):
    """Remove operations that return their input unchanged (Identity, Dropout, Cast to its own type, ...)"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        # Imported here: a pipeline that names only dce or cse does not load the fuse package.
        from graphopt.passes.fuse.engine import RuleSet, RunStats, Site, sweep
        from graphopt.passes.fuse.rules import noop

        stats = RunStats()

        def site_for(graph: Graph) -> Site:
            return Site(model, graph, model.opset_in(graph), ctx.settings.target, ctx)

        sweep(model, RuleSet(noop.RULES), site_for, stats)
        return PassResult(bool(stats.applied), {"removed": dict(sorted(stats.applied.items()))})
