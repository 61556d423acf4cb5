"""Running optimized models: :class:`CachedSession` folds runtime constants once per content."""

from graphopt.runtime.session import CachedSession

__all__ = ["CachedSession"]
