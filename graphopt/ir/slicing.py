"""ONNX's Slice bounds along one axis, as onnxruntime reads them: shared by the shape facts and the evaluator."""

from __future__ import annotations

__all__ = ["slice_of"]

# The int32 and int64 maxima.
_OPEN_ENDS = (2**31 - 1, 2**63 - 1)


def slice_of(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX's bounds as a Python slice: negatives count from the end once, then clamp (a start before the
    first entry with a negative step still takes the first entry, which Python's own clamping would not)."""
    if step == 0:
        raise ValueError("a Slice step is 0")
    if end in _OPEN_ENDS and step < 0:
        # onnxruntime reads these ends as numpy's None: through the first element.
        end = -dim - 1
    start, end = (b + dim if b < 0 else b for b in (start, end))
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    if dim == 0:
        return slice(0, 0)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    # An end of -1 means "through index 0", which a Python slice spells None.
    return slice(start, None if end < 0 else end, step)
