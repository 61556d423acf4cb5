"""MatMul / Gemm family: bias Adds and Transposes folded into Gemm, onnxruntime's FusedGemm and FusedMatMul
(standard.py), dynamic int8 MatMuls as onnxruntime's DynamicQuantizeMatMul (quantized.py), and a tied
weight read transposed as Gemm's transB (tied.py).

The library lists the two modules apart (rules/__init__.py, whose order is the rules' priority): tied.py's
rule stays last, where it was registered before the family became a package."""

from __future__ import annotations

from graphopt.passes.fuse.rules.matmul import quantized, standard, tied

__all__ = ["quantized", "standard", "tied"]
