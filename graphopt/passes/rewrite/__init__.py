"""The rewrite engine: a pattern language and a driver that applies rules to a graph.

Rules are values (:class:`Rule`), composed into a :class:`RuleSet` whose op index is built
once; the fuse pass runs the rule library, the noop pass its single-node rules, both
through the same engine. See graphopt/passes/README.md for the pattern language and the
engine's guarantees.
"""
