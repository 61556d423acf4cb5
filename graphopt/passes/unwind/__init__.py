"""The unwind family: choose tensor layouts to maximize the layout objective.

The problem and its solvers live in :mod:`graphopt.layout`; here :mod:`onnx_layouts` derives the
problem of an ONNX model, :mod:`rewrite` writes its answer back, :mod:`layout_pass` is the
``unwind`` pass.
"""

from graphopt.passes.unwind.layout_pass import Unwind

__all__ = ["Unwind"]
