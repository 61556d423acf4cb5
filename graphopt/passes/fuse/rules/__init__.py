"""The built-in rule families, one module each; importing them registers their rules."""

from graphopt.passes.fuse.rules import (  # noqa: F401
    activation,
    arith,
    attention,
    conv,
    expose,
    kronecker,
    lower,
    matmul,
    norm,
    shape,
    tied,
)
