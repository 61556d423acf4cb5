"""The facts service: the type and symbolic value of any value, on demand.

A pass asks ``facts.sym(v)`` ("what small int tensor is this, over dims?") or
``facts.infer_node(node)`` ("type this new node's outputs"); the answers come from the
rule tables in :mod:`graphopt.facts.rules` and :mod:`graphopt.facts.values`, computed for
exactly the values asked about and the values they depend on. Answers are memoized and
dropped when the model's structure changes (every IR mutation bumps a graph's version).

The whole-model inference that the ``shape-infer`` pass runs (:mod:`graphopt.facts.infer`)
works through the same memo, so what it computes stays available to later passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from graphopt.facts.contrib import type_rule
from graphopt.facts.op import MAX_CONST_SIZE, MAX_VALUE_LEN, Op, SymValue
from graphopt.facts.values import VALUE_RULES
from graphopt.ir import DataType, Model, Node, TensorType, Type, Value
from graphopt.ir.constness import constant_array
from graphopt.ir.types import INTEGER_TYPES

__all__ = ["Facts", "OnnxTypes"]

# What io provides: onnx's own inference over a model, types keyed by id of each value.
OnnxTypes = Callable[[Model], dict[int, Type]]

_SYMBOLIC_VALUE_TYPES = INTEGER_TYPES | {DataType.BOOL}


class Facts:
    """Types and symbolic values for one model (see the module docstring)."""

    def __init__(self, model: Model, *, independent_dims: bool = False, onnx_types: OnnxTypes | None = None) -> None:
        self.model = model
        self.independent_dims = independent_dims
        self.onnx_types = onnx_types
        self._syms: dict[Value, SymValue | None] = {}
        self._stamp = self._current_stamp()
        self._onnx_seeds: tuple[tuple[int, ...], dict[int, Type]] | None = None

    # -- memo upkeep ------------------------------------------------------------------------
    def _current_stamp(self) -> tuple[int, ...]:
        return (self.model.graph._version, *(f.body._version for f in self.model.functions))

    def _fresh(self) -> None:
        stamp = self._current_stamp()
        if stamp != self._stamp:
            self._syms.clear()
            self._stamp = stamp

    def record(self, value: Value, symbolic: SymValue | None) -> None:
        """Remember ``value``'s symbolic value (None: unknown), if its type allows one."""
        self._fresh()
        self._syms[value] = symbolic if _can_hold(value, symbolic) else None

    def forget(self, value: Value) -> None:
        self._syms.pop(value, None)

    def onnx_seeds(self) -> dict[int, Type]:
        """onnx's types for the model as it is now (keyed by ``id`` of its values), computed
        at most once while no graph changes."""
        stamp = self._current_stamp()
        if self._onnx_seeds is None or self._onnx_seeds[0] != stamp:
            found = self.onnx_types(self.model) if self.onnx_types is not None else {}
            self._onnx_seeds = (stamp, found)
        return self._onnx_seeds[1]

    # -- queries ----------------------------------------------------------------------------
    def op(self, node: Node) -> Op:
        """``node`` as the rules see it, at the opset that holds where it is."""
        graph = node.graph
        opset = self.model.opset_in(graph) if graph is not None else self.model.opset
        return Op(node, opset, self)

    def sym(self, value: Value) -> SymValue | None:
        """The flattened content of a small int tensor (a scalar, a vector, or a grid of int dims),
        entries being dims, or None."""
        self._fresh()
        if value in self._syms:
            return self._syms[value]
        # Depth first without recursion: shape plumbing can be thousands of nodes deep.
        pending = [value]
        visiting: set[Value] = set()
        while pending:
            current = pending[-1]
            if current in self._syms:
                pending.pop()
                continue
            node = current.producer
            rule = VALUE_RULES.get(node.op_type) if node is not None and node.in_standard_domain else None
            if node is None or rule is None:
                self._syms[current] = self._constant_sym(current)
                pending.pop()
                continue
            missing = [v for v in node.inputs if v is not None and v not in self._syms]
            if missing and current not in visiting:
                visiting.add(current)
                pending.extend(missing)
                continue
            if missing:  # still missing after a visit: the inputs depend on this value (a cycle)
                self._syms[current] = None
                pending.pop()
                continue
            try:
                found = rule(self.op(node))
            except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
                found = []
            for index, output in enumerate(node.outputs):
                symbolic = found[index] if index < len(found) else None
                self._syms[output] = symbolic if _can_hold(output, symbolic) else None
            pending.pop()
        return self._syms.get(value)

    def _constant_sym(self, value: Value) -> SymValue | None:
        data = constant_array(value, MAX_CONST_SIZE)
        if data is None or data.size > MAX_VALUE_LEN or data.dtype.kind not in "iub":
            return None
        return tuple(int(x) for x in data.ravel())

    def infer_node(self, node: Node) -> None:
        """Give ``node``'s untyped outputs the types its rule computes from its inputs' types."""
        rule = type_rule(node)
        if rule is None:
            return
        try:
            inferred = rule(self.op(node))
        except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
            return
        for value, kind in zip(node.outputs, inferred, strict=False):
            if value.type is None and kind is not None:
                value.type = kind


def _can_hold(value: Value, symbolic: SymValue | None) -> bool:
    """Whether ``value`` is a tensor that may carry the symbolic value (small int, of a static size past rank 1)."""
    kind = value.type
    if symbolic is None or len(symbolic) > MAX_VALUE_LEN:
        return False
    if kind is None:
        return True  # an untyped constant or plumbing output; its producer's rule vouches for it
    if not isinstance(kind, TensorType) or kind.dtype not in _SYMBOLIC_VALUE_TYPES or kind.shape is None:
        return False
    if kind.rank == 1:
        return True
    # Rank 0, or a grid whose every dim is an int (the values module's docstring): as many entries.
    dims = [d for d in kind.shape if isinstance(d, int)]
    return len(dims) == kind.rank and math.prod(dims) == len(symbolic)
