"""The built-in rule families, one module each; importing them registers their rules."""

from graphopt.passes.fuse.rules import activation, arith, attention, conv, matmul, norm, rotary, shape, tied  # noqa: F401
