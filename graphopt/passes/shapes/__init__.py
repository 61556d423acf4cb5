"""Shape passes: ``shape-infer`` (over the facts service) and ``strip-value-info``."""

from graphopt.passes.shapes import infer, strip

__all__ = ["infer", "strip"]
