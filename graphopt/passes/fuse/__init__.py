"""The fuse / shatter pattern engine and its rule library (the ``fuse`` pass).

Add a rule from Python::

    from graphopt.passes.fuse import Rule, add_rule, op, var

    add_rule(Rule("neg-neg", "arith", op.Neg(op.Neg(var("x"))), lambda b, m, site: m.value("x")))

See graphopt/passes/README.md for the pattern language and the engine's guarantees.
"""

from graphopt.passes.fuse import fuse_pass, rules  # noqa: F401  (registers the pass and the rules)
from graphopt.passes.fuse.engine import Match, Rule, Site, add_rule, registered_rules, remove_rule
from graphopt.passes.fuse.patterns import const, either, op, optional, scalar, var

__all__ = [
    "Match",
    "Rule",
    "Site",
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
