"""Shape inference: symbolic types for every value, dims kept as names and expressions."""

from graphopt.passes.shapes import infer, rules, strip, values

__all__ = ["infer", "rules", "strip", "values"]
