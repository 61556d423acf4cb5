"""The built-in rule families, one module each; importing them registers their rules."""

from graphopt.passes.fuse.rules import activation, arith, attention, conv, gather, matmul, norm, shape, tied  # noqa: F401
