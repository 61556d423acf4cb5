"""The fuse rule library and the ``fuse`` pass (the engine is graphopt.passes.rewrite).

Add a rule from Python::

    from graphopt.passes.fuse import Rule, add_rule, op, var

    add_rule(Rule(name="neg-neg", family="arith", pattern=op.Neg(op.Neg(var("x"))), build=lambda b, m, p: m.value("x")))

See graphopt/passes/README.md for the pattern language and the engine's guarantees.
"""

from graphopt.passes.fuse.fuse_pass import add_rule, registered_rules, remove_rule
from graphopt.passes.rewrite.engine import Match, Refuse, Rule, RuleSet, Site, Unreadable
from graphopt.passes.rewrite.patterns import const, either, op, optional, scalar, var

__all__ = [
    "Match",
    "Refuse",
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
