"""The const-cache pass: constness, folding with size guards, symbolic shapes, runtime folds.

Importing the package registers the pass (see :mod:`graphopt.passes.constcache.pass_`).
"""

from graphopt.passes.constcache.pass_ import ConstCache

__all__ = ["ConstCache"]
