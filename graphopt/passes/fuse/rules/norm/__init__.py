"""Normalization family: LayerNorm, RMSNorm, GroupNorm and Softmax decompositions become one op
(standard.py, with onnxruntime's skip norms for ``--target ort``), and the residual sum a LayerNormalization
reads is written as ``Sum`` (residual.py)."""

from __future__ import annotations

from graphopt.passes.fuse.rules.norm import residual, standard

__all__ = ["residual", "standard"]
