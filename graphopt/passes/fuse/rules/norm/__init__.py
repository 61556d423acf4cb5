"""Normalization family: LayerNorm, RMSNorm, GroupNorm and Softmax decompositions become one op
(standard.py, with onnxruntime's skip norms for ``--target ort``), and the residual sum a LayerNormalization
reads is written as ``Sum`` (residual.py)."""

from __future__ import annotations

from typing import Any

from graphopt.passes.fuse.rules.norm import residual, standard
from graphopt.passes.rewrite.engine import Rule

__all__ = ["RULES"]

# standard.py first: its skip norms win the tie with the residual sum (see residual.py)
RULES: tuple[Rule[Any], ...] = standard.RULES + residual.RULES
