"""Passes over the IR. Each family registers its passes in graphopt.passes.base."""

from graphopt.passes.base import Pass, PassContext, PassResult, all_passes, get_pass, register

__all__ = ["Pass", "PassContext", "PassResult", "all_passes", "get_pass", "register"]
