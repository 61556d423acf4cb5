"""Op tables of the standard domain that layers above the IR share (one source of truth)."""

from __future__ import annotations

__all__ = ["BITWISE", "BROADCASTING", "BROADCASTING_ARITHMETIC", "COMPARISONS"]

# The ops whose inputs broadcast multidirectionally (numpy-style), grouped by what they give:
# the type of their inputs, the type of their inputs on integers only, and bool.
BROADCASTING_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "PRelu")
BITWISE = ("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
COMPARISONS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor")
BROADCASTING = frozenset((*BROADCASTING_ARITHMETIC, *BITWISE, *COMPARISONS, "Where"))
