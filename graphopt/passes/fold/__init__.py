"""The fold pass: batch same-level sibling ops into one op, with a fold index (fold.py)."""

from graphopt.passes.fold.fold import FoldSiblings

__all__ = ["FoldSiblings"]
