"""Ops that run in any layout once their per-axis parameters are renumbered.

A Pad, a Slice, a Concat... computes the same thing on ``x.transpose(L)`` as on ``x``,
given the parameters that name or list ``x``'s axes rewritten for ``L``: the op then keeps
its input's layout, a view in the layout problem, and a Transpose pair around it cancels.
Each op is described here by data, not code: which inputs carry the layout and, for each
per-axis parameter (an attribute, or an input that must be a constant), how it maps:

- ``axis``: one axis, renumbered (Concat, Split, Gather, Softmax, CumSum, TopK, ...);
- ``axes``: a list of axes, each renumbered (Pad's and Slice's ``axes`` input);
- ``per_axis``: one entry per axis, permuted (Tile's repeats, Resize's scales / sizes,
  Expand's shape, Slice's starts / ends / steps without ``axes``);
- ``begin_end``: the begins of every axis then the ends, each half permuted (Pad's pads,
  Resize's roi).

Where the op's ``axes`` parameter is given, its vectors are per listed axis: renumbering
the axes is the whole change. A per-axis input that is not a constant cannot be rewritten,
so the op is a barrier (the unwind pass's ``fixed``). Every output keeps the rank and the
layout of the input; a description that would change the rank (Gather with scalar
indices, Expand to a higher rank) is not this op's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from graphopt.ir import AttrKind, Node
from graphopt.ir.constness import constant_array

__all__ = ["PER_AXIS_OPS", "AxisOp", "Param", "Reading", "mapped", "read_params", "runs_in"]

Mapping = Literal["axis", "axes", "per_axis", "begin_end"]
Number = int | float


@dataclass(frozen=True)
class Param:
    """A per-axis parameter: attribute ``at`` (a name) or input ``at`` (an index)."""

    at: str | int
    maps: Mapping
    # An axis attribute's value when it is absent (None: the op needs it).
    default: int | None = None


@dataclass(frozen=True)
class AxisOp:
    params: tuple[Param, ...]
    # The inputs that carry the layout, the first one leading (None: every input, as Concat's).
    data: tuple[int, ...] | None = (0,)
    # The first opset this description holds for.
    since: int = 1

    def data_inputs(self, node: Node) -> list[int]:
        indices = range(len(node.inputs)) if self.data is None else self.data
        return [index for index in indices if node.input(index) is not None]


def _axis(default: int | None = None) -> tuple[Param, ...]:
    return (Param("axis", "axis", default),)


_SOFTMAX = AxisOp(_axis(-1), since=13)  # before 13 the axis flattened the trailing axes
PER_AXIS_OPS: dict[str, AxisOp] = {
    # Pad-2 pads attribute; from 11 the pads input, from 18 the axes input.
    "Pad": AxisOp((Param("pads", "begin_end"), Param(1, "begin_end"), Param(3, "axes"))),
    # Slice-1 attributes; from 10 inputs starts, ends, axes, steps.
    "Slice": AxisOp(
        (
            Param("starts", "per_axis"),
            Param("ends", "per_axis"),
            Param("axes", "axes"),
            Param(1, "per_axis"),
            Param(2, "per_axis"),
            Param(3, "axes"),
            Param(4, "per_axis"),
        )
    ),
    # X, roi, scales, sizes (from 11); the axes attribute from 18.
    "Resize": AxisOp(
        (Param(1, "begin_end"), Param(2, "per_axis"), Param(3, "per_axis"), Param("axes", "axes")), since=11
    ),
    "Tile": AxisOp((Param(1, "per_axis"),), since=6),
    "Expand": AxisOp((Param(1, "per_axis"),), since=8),
    "Concat": AxisOp(_axis(), data=None, since=4),
    "Split": AxisOp(_axis(0), since=2),  # the split sizes run along the axis: unchanged
    "Gather": AxisOp(_axis(0)),  # the indices are positions along the axis: unchanged
    # Indices (and updates) of the data's shape, laid out as the data.
    "GatherElements": AxisOp(_axis(0), data=(0, 1), since=11),
    "ScatterElements": AxisOp(_axis(0), data=(0, 1, 2), since=11),
    "CumSum": AxisOp((Param(1, "axis"),), since=11),
    "TopK": AxisOp(_axis(-1), since=10),  # values and indices, both of the input's rank
    "ArgMax": AxisOp(_axis(0)),  # keepdims=1 only: the output keeps the rank
    "ArgMin": AxisOp(_axis(0)),
    "LpNormalization": AxisOp(_axis(-1)),
    "Softmax": _SOFTMAX,
    "LogSoftmax": _SOFTMAX,
    "Hardmax": _SOFTMAX,
}

# A parameter as read from the model: its values (None where the op leaves it out).
Reading = tuple[Param, tuple[Number, ...] | None]


def _values(node: Node, param: Param) -> tuple[Number, ...] | Literal[False] | None:
    """The parameter's values, None when absent, False when they cannot be read."""
    if isinstance(param.at, str):
        attr = node.attributes.get(param.at)
        if attr is None:
            return None if param.default is None else (param.default,)
        if attr.kind not in (AttrKind.INT, AttrKind.INTS):
            return False
        return tuple(int(v) for v in (attr.value if attr.kind == AttrKind.INTS else [attr.value]))
    value = node.input(param.at)
    if value is None:
        return None
    array = constant_array(value)
    if array is None or array.ndim > 1 or array.dtype.kind not in "iuf":
        return False
    return tuple(array.ravel().tolist()) if array.size else None  # Resize's empty roi / scales: absent


def read_params(node: Node, rank: int) -> tuple[Reading, ...] | None:
    """The op's per-axis parameters, checked against ``rank``; None when the op cannot
    follow a layout (a parameter to rewrite not constant, out of range, of the wrong length)."""
    readings: list[Reading] = []
    unread: list[Param] = []
    for param in PER_AXIS_OPS[node.op_type].params:
        values = _values(node, param)
        if values is False:
            unread.append(param)
        readings.append((param, values or None))
    listed = any(param.maps == "axes" and values is not None for param, values in readings)
    for param, values in readings:
        # A vector per listed axis stays as it is: it need not fit the rank, nor be a constant.
        vector = param.maps in ("per_axis", "begin_end")
        if values is not None and not (listed and vector) and not _fits(param.maps, values, rank):
            return None
        if param in unread and not (listed and vector):
            return None
    if node.op_type == "Resize" and not _nearest(node) and not _scaled(readings):
        return None
    return tuple(readings)


def _fits(maps: Mapping, values: tuple[Number, ...], rank: int) -> bool:
    if maps in ("axis", "axes"):
        if not all(isinstance(v, int) and -rank <= v < rank for v in values):
            return False
        return len({int(v) % rank for v in values}) == len(values) and (maps == "axes" or len(values) == 1)
    return len(values) == (rank if maps == "per_axis" else 2 * rank)


def _nearest(node: Node) -> bool:
    return node.attr("mode", b"nearest") == b"nearest"


def _scaled(readings: list[Reading] | tuple[Reading, ...]) -> tuple[Number, ...] | None:
    """A Resize's scales over every axis (None when it has sizes or an axes attribute)."""
    found = dict((param.at, values) for param, values in readings)
    return found[2] if found.get("axes") is None else None


def mapped(readings: tuple[Reading, ...], layout: tuple[int, ...]) -> dict[Param, tuple[Number, ...]]:
    """The parameters that change when the op runs on its input laid out by ``layout``."""
    where = [0] * len(layout)
    for position, axis in enumerate(layout):
        where[axis] = position
    rank = len(layout)
    listed = any(param.maps == "axes" and values is not None for param, values in readings)
    changed: dict[Param, tuple[Number, ...]] = {}
    for param, values in readings:
        if values is None:
            continue
        new: tuple[Number, ...]
        if param.maps in ("axis", "axes"):
            if all(where[int(v) % rank] == int(v) % rank for v in values):
                continue  # the same axes, however written (-1 stays -1)
            new = tuple(where[int(v) % rank] for v in values)
        elif listed:  # vectors per listed axis
            continue
        elif param.maps == "per_axis":
            new = tuple(values[a] for a in layout)
        else:
            new = tuple(values[a] for a in layout) + tuple(values[rank + a] for a in layout)
        if new != values:
            changed[param] = new
    return changed


def runs_in(node: Node, readings: tuple[Reading, ...], layout: tuple[int, ...]) -> bool:
    """Whether onnxruntime runs the op with its parameters mapped to ``layout``: a linear or
    cubic Resize only with unit scales on the outermost two axes, or on the outermost and
    the innermost of four (its kernels' own conditions, upsamplebase.h; a nearest one runs
    in any layout)."""
    if node.op_type != "Resize" or _nearest(node):
        return True
    scales = next((new for param, new in mapped(readings, layout).items() if param.at == 2), _scaled(readings))
    assert scales is not None  # read_params let the Resize follow layouts only with scales
    rank = len(scales)
    if rank <= 2 or (rank == 3 and node.attr("mode") == b"linear"):
        return True
    if scales[0] == 1 and scales[1] == 1:
        return True
    # A cubic one in this form either antialiases or only enlarges.
    cubic_form = node.attr("mode") != b"cubic" or bool(node.attr("antialias", 0)) or min(scales) >= 1
    return rank == 4 and scales[0] == 1 and scales[3] == 1 and cubic_form


def as_array(original: np.ndarray | None, values: tuple[Number, ...]) -> np.ndarray:
    """``values`` in the dtype and shape of the input they replace (CumSum's axis is 0-d)."""
    if original is None:
        return np.array(values, dtype=np.int64)
    return np.array(values, dtype=original.dtype).reshape(original.shape)
