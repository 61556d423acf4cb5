"""The built-in rule families, one module each; importing them registers their rules."""

from graphopt.passes.fuse.rules import (  # noqa: F401
    activation,
    arith,
    attention,
    conv,
    embed,
    expose,
    gather,
    kronecker,
    lower,
    matmul,
    norm,
    rotary,
    shape,
    tied,
)
