"""The tied-weight rule: MatMul(x, Transpose(W)) reads W transposed through Gemm, no copy."""

from __future__ import annotations

from collections import Counter

from tests.numerics import assert_same_outputs
from tests.passes.fuse_helpers import fuse, ops
from tests.passes.fuse_models import tied


def test_a_tied_weight_is_read_transposed_by_gemm_with_dynamic_leading_dims() -> None:
    proto = tied(["batch", "seq", 6])
    out, details = fuse(proto)
    assert details["applied"]["tied-weight-gemm"] == 1
    assert ops(out)["Transpose"] == 0 and ops(out)["Gemm"] == 1
    assert [t.name for t in out.graph.initializer if t.dims == [10, 6]] == ["wte"]  # one copy of the weight
    assert [o.name for o in out.graph.output] == ["logits"]
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_static_and_matrix_activations() -> None:
    for shape in ([3, 6], [2, 3, 6]):
        proto = tied(shape)
        out, details = fuse(proto)
        assert details["applied"]["tied-weight-gemm"] == 1 and ops(out)["Shape"] == 0
        assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)


def test_refusals() -> None:
    # the Transposed weight has another reader; dynamic leading dims below opset 15
    for proto in (tied(["batch", "seq", 6], extra_reader=True), tied(["batch", "seq", 6], opset=14)):
        out, details = fuse(proto)
        assert "tied-weight-gemm" not in details["applied"], details
        assert Counter(ops(out))["Transpose"] == 1
        assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)
    # for onnxruntime, FusedMatMul reads the weight transposed instead
    proto = tied(["batch", "seq", 6])
    out, details = fuse(proto, target="ort")
    assert "tied-weight-gemm" not in details["applied"] and ops(out)["FusedMatMul"] == 1, details
    assert_same_outputs(proto, out, rtol=1e-5, atol=1e-5)
