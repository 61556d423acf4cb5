"""Postponing expanding ops (the seed's section 3.5): f(Expand(x, s), c...) -> Expand(f(x, c...), s).

Folding an Expand or a Tile of a constant stores a big tensor, so the size guard refuses
it, and that used to stop folding everything after it. Moving the expansion after an
element-wise op makes f(x, c...) a small constant that folds, while the expansion stays.

Legal when:
- f is element-wise and position-independent (every output element depends only on the
  input elements at the same broadcast index);
- x and every other operand c are constants (compile-time or runtime), and the c
  broadcast against x's shape without growing it (not only against the Expand's output);
- f's output shape is the Expand's output shape (so the result shape is unchanged);
- for Tile, every c has size 1 on each axis that may repeat.
The Expand is duplicated when something else reads it (the old one then stays for them).

Also implicit broadcasting: when f broadcasts by itself to the same shape without the
Expand (``Add(Expand(b, Shape(x)), x)``), f reads b directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from graphopt.facts.op import broadcast
from graphopt.ir import Dim, Graph, Node, tensor_shape
from graphopt.ir.constness import constant_array
from graphopt.ir.rewrite import Builder, replace_value
from graphopt.passes.constcache.lattice import Constness, Lattice

__all__ = ["ELEMENTWISE", "postpone_expansions"]

ELEMENTWISE = frozenset(
    {
        # unary
        "Abs", "Acos", "Asin", "Atan", "Ceil", "Cos", "Cosh", "Erf", "Exp", "Floor", "Identity", "IsInf", "IsNaN",
        "Log", "Neg", "Not", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign",
        "Sqrt", "Tan", "Tanh", "Cast", "Elu", "LeakyRelu", "Selu", "HardSigmoid", "HardSwish", "Gelu", "Mish",
        # broadcasting
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "And", "Or", "Xor", "Equal", "Less", "Greater",
        "LessOrEqual", "GreaterOrEqual", "Where", "Sum", "Mean", "BitShift", "Clip",
    }
)  # fmt: skip
_EXPANDING = ("Expand", "Tile")


def postpone_expansions(graph: Graph, lattice: Lattice, make: Callable[[Node], Builder]) -> Counter[str]:
    """Apply the rewrites of the module docstring to ``graph``; ``make(before)`` gives a builder."""
    done: Counter[str] = Counter()
    for node in graph.topological():
        if node.graph is not graph or not node.in_standard_domain or node.op_type not in ELEMENTWISE:
            continue
        if len(node.outputs) != 1 or any(a.ref_attr_name for a in node.attributes.values()):
            continue
        for index, operand in enumerate(node.inputs):
            expansion = operand.producer if operand is not None else None
            if expansion is None or expansion.op_type not in _EXPANDING or not expansion.in_standard_domain:
                continue
            if _postpone(node, index, expansion, lattice, make):
                done[f"{expansion.op_type.lower()}_postponed"] += 1
                break
            if _absorb(node, index, expansion):
                done[f"{expansion.op_type.lower()}_absorbed"] += 1
                break
    return done


def _postpone(node: Node, index: int, expansion: Node, lattice: Lattice, make: Callable[[Node], Builder]) -> bool:
    x = expansion.inputs[0]
    others = [v for i, v in enumerate(node.inputs) if i != index and v is not None]
    if x is None or any(lattice[v] == Constness.VAR for v in [x, *others]):
        return False
    x_shape, out_shape = tensor_shape(x), tensor_shape(node.outputs[0])
    shapes = [tensor_shape(v) for v in others]
    if x_shape is None or out_shape is None or out_shape != tensor_shape(expansion.outputs[0]):
        return False
    small = broadcast([x_shape, *shapes])
    if small is None or small != (1,) * (len(small) - len(x_shape)) + tuple(x_shape) or len(small) > len(out_shape):
        return False
    if any(d is None for d in out_shape):
        return False
    if expansion.op_type == "Tile" and not _tile_safe(expansion, x_shape, shapes):
        return False
    b = make(node)
    inputs = list(node.inputs)
    inputs[index] = x
    attributes: dict[str, Any] = dict(node.attributes)
    inner = b.node(node.op_type, *inputs, domain=node.domain, **attributes)
    expanded = b.op(expansion.op_type, inner.outputs[0], expansion.inputs[1])
    expanded.type = node.outputs[0].type
    lattice.of[inner.outputs[0]] = max(lattice[v] for v in [x, *others])
    lattice.of[expanded] = max(lattice.of[inner.outputs[0]], lattice[expansion.inputs[1]])
    replace_value(node.outputs[0], expanded, b.names)
    graph = node.graph
    assert graph is not None
    graph.remove(node)
    if not expansion.outputs[0].is_used() and expansion.graph is not None:
        expansion.graph.remove(expansion)  # now, so that the constants it read count as freed
    return True


def _tile_safe(tile: Node, x_shape: Sequence[Dim], shapes: Sequence[tuple[Dim, ...] | None]) -> bool:
    """Whether every other operand has size 1 on each axis the Tile may repeat."""
    repeats = constant_array(tile.inputs[1]) if len(tile.inputs) > 1 else None
    rank = len(x_shape)
    for shape in shapes:
        if shape is None or len(shape) > rank:
            return False
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        for axis, dim in enumerate(padded):
            repeated = repeats is None or int(repeats.ravel()[axis]) != 1
            if repeated and dim != 1:
                return False
    return True


def _absorb(node: Node, index: int, expansion: Node) -> bool:
    """f(Expand(b, s), y...) -> f(b, y...) when f's own broadcasting gives the same shape."""
    if expansion.op_type != "Expand" or len(node.inputs) < 2:
        return False
    source = expansion.inputs[0]
    out_shape = tensor_shape(node.outputs[0])
    shapes = [tensor_shape(source if i == index else v) for i, v in enumerate(node.inputs) if v is not None]
    if source is None or out_shape is None or any(d is None for d in out_shape):
        return False
    if broadcast(shapes) != tuple(out_shape):
        return False
    node.set_input(index, source)
    return True
