"""The rewrite engine, its rule library and the ``fuse`` pass.

Add a rule from Python::

    from graphopt.passes.fuse import Rule, add_rule, op, var

    add_rule(Rule(name="neg-neg", family="arith", pattern=op.Neg(op.Neg(var("x"))), build=lambda b, m, p: m.value("x")))

See graphopt/passes/README.md for the pattern language and the engine's guarantees.
"""

from graphopt.passes.fuse.engine import Match, Rule, RuleSet, Site, Unreadable
from graphopt.passes.fuse.fuse_pass import add_rule, registered_rules, remove_rule
from graphopt.passes.fuse.patterns import const, either, op, optional, scalar, var

__all__ = [
    "Match",
    "Rule",
    "RuleSet",
    "Site",
    "Unreadable",
    "add_rule",
    "const",
    "either",
    "op",
    "optional",
    "registered_rules",
    "remove_rule",
    "scalar",
    "var",
]
