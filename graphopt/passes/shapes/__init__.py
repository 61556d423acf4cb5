"""Shape inference: symbolic types for every value, dims kept as names and expressions."""

from graphopt.passes.shapes import infer, rules, values

__all__ = ["infer", "rules", "values"]
