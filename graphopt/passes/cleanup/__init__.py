"""Hygiene passes: remove no-ops (``noop``), dead code (``dce``) and repeated work (``cse``).

Importing the package registers the passes; the default pipeline runs them as the
``cleanup`` group, repeated until none of them changes anything.
"""

from graphopt.passes.cleanup import cse, dce, noop

__all__ = ["cse", "dce", "noop"]
