"""Op tables of the standard domain that layers above the IR share (one source of truth)."""

from __future__ import annotations

__all__ = [
    "BITWISE",
    "BROADCASTING",
    "BROADCASTING_ARITHMETIC",
    "COMPARISONS",
    "ELEMENTWISE_BINARY",
    "ELEMENTWISE_UNARY",
    "CARRIERS",
    "MOVES",
]

# The ops whose inputs broadcast multidirectionally (numpy-style), grouped by what they give:
# the type of their inputs, the type of their inputs on integers only, and bool.
BROADCASTING_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "PRelu")
BITWISE = ("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
COMPARISONS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor")
BROADCASTING = frozenset((*BROADCASTING_ARITHMETIC, *BITWISE, *COMPARISONS, "Where"))

# One-input element-wise ops: the output has the input's shape, each element from its own.
ELEMENTWISE_UNARY = frozenset(
    {
        "Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu", "Softplus", "Softsign",
        "Gelu", "Erf", "Exp", "Log", "Sqrt", "Abs", "Neg", "Reciprocal", "Clip", "Cast",
    }
)  # fmt: skip
# The arithmetic that, with a constant operand, is element-wise in its other one.
ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
# Ops that move elements without computing on them (input 0 the data): on quantized integers as on
# the floats they stand for.
MOVES = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather")
# The moves and Expand, which repeats elements without computing on them either.
CARRIERS = frozenset({*MOVES, "Expand"})
