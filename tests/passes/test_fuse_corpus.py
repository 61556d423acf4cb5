"""The fuse pass on corpus transformers taken to opset 23: one Attention per layer, norms as
LayerNormalization, one Gelu per MLP, numerics unchanged."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from graphopt.api import optimize
from graphopt.io.onnx_write import to_proto
from tests.numerics import assert_same_outputs

# Without the const-cache pass the shape plumbing (and Constant nodes) stay; with it both
# models reach at most 90 nodes.
CEILING = {"bert_small": 100, "gpt2_small": 80}


@pytest.mark.parametrize("name", ["bert_small", "gpt2_small"])
def test_target_opset_23_fuses_each_layer(corpus_dir: Path, name: str) -> None:
    path = corpus_dir / f"{name}.onnx"
    result = optimize(path, target_opset=23, check=False)
    counts = Counter(n.op_type for n in result.model.all_nodes())
    assert counts["Attention"] == 4 and counts["Gelu"] == 4 and counts["LayerNormalization"] == 9
    assert not {"Softmax", "Erf", "ReduceMean", "Pow", "Sqrt"} & set(counts)
    assert sum(counts.values()) <= CEILING[name]
    assert result.model.opset == 23
    assert_same_outputs(path, to_proto(result.model), rtol=1e-3, atol=1e-4)


# onnxruntime's own node counts at its extended level (corpus README), for --target ort.
ORT_EXTENDED = {"bert_small": 131, "gpt2_small": 145}


@pytest.mark.parametrize("name", ["bert_small", "gpt2_small"])
def test_target_ort_fuses_each_layer_into_contrib_ops(corpus_dir: Path, name: str) -> None:
    path = corpus_dir / f"{name}.onnx"
    result = optimize(path, target="ort", check=False)
    counts = Counter(n.op_type for n in result.model.all_nodes())
    assert counts["Attention"] == 4 and counts["LayerNormalization"] == 9
    assert sum(counts.values()) <= ORT_EXTENDED[name]
    assert_same_outputs(path, to_proto(result.model), rtol=1e-3, atol=1e-4)
