"""The built-in rule families, one module each, composed into the library the fuse pass runs.

Each family module exports its rules as ``RULES``; :data:`LIBRARY` lists them in priority
order: where two rules rooted at the same op cover as many nodes, the earlier one wins.
The noop family is not in the library (the ``noop`` pass sweeps it); the shape family
shares two of its rules.
"""

from graphopt.passes.fuse.rules import (
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
    qdq,
    rotary,
    shape,
)
from graphopt.passes.rewrite.engine import RuleSet

__all__ = ["LIBRARY"]

LIBRARY = RuleSet(
    activation.RULES
    + arith.RULES
    + attention.RULES
    + conv.RULES
    + embed.RULES
    + expose.RULES
    + gather.RULES
    + kronecker.RULES
    + lower.RULES
    + matmul.standard.RULES
    + matmul.quantized.RULES
    + norm.RULES
    + qdq.RULES
    + rotary.RULES
    + shape.RULES
    + matmul.tied.RULES
)
