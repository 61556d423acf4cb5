"""The conv rules' table: Conv with its BatchNormalization, channel scale / bias, padding and activation. Each rule
fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the
exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from tests.cli_helpers import invoke
from tests.numerics import make_feeds
from tests.passes.fuse.table import (
    CONSTANTS_ONLY,
    ELEMENTWISE,
    NO_GATE,
    Case,
    Exported,
    Perturb,
    constant_at,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    training,
    untyped_at,
    weights,
)
from tests.passes.fuse_helpers import fires, ops
from tests.passes.fuse_models import (
    conv_act,
    conv_bn,
    conv_branches,
    conv_channel,
    conv_input_scale,
    gemm_bn,
    padded,
    residual_block,
)


def _per_row_of_channels(values: np.ndarray) -> np.ndarray:
    """A (C, 1, 1) scale made to vary along the 8 rows of make.py's poolformer maps too."""
    rows = np.linspace(0.5, 1.5, 8, dtype=values.dtype).reshape(1, 8, 1)
    return (values.reshape(-1, 1, 1) * rows).astype(values.dtype)


CASES: dict[str, Case] = {
    "conv-bn": Case(
        conv_bn,
        {"Conv": 1},
        "c",
        Perturb(training, None, note="training_mode=1"),
        CONSTANTS_ONLY,
        NO_GATE,
    ),
    **{
        f"conv-{op.lower()}": Case(
            lambda op=op: conv_channel(weights(4), op),
            {"Conv": 1, "Transpose": 1},
            "c",
            # channels last no more: the operand would scale H, which is as long as C here
            Perturb(
                lambda p: set_attr("t", perm=[0, 1, 3, 2])(set_shape("x", [1, 3, 4, 4])(p)),
                "not per-channel",
                feeds=make_feeds,
            ),
            Perturb(set_shape("x", None), "output rank is unknown"),
            NO_GATE,
        )
        for op in ("Mul", "Add", "Sub")
    },
    "mul-conv": Case(
        lambda: conv_input_scale(weights(4, 1, 1)),
        {"Conv": 1},
        "m",
        Perturb(set_const("k", weights(4, 5, 1)), "not per input channel", note="the scale varies along H"),
        Perturb(set_shape("x", None), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
    "ort-fusedconv": Case(
        conv_act,
        {"FusedConv": 1},
        "c",
        "n/a: FusedConv takes the Conv's attributes as they are",
        ELEMENTWISE,
        NO_GATE,
        {"target": "ort"},
    ),
    "ort-fusedconv-sum": Case(
        residual_block,
        {"Conv": 1, "FusedConv": 1},
        "s",
        "n/a: FusedConv takes the Conv's attributes as they are",
        Perturb(set_shape("x", None), "not provably the Conv's"),
        NO_GATE,
        {"target": "ort"},
    ),
    "gemm-bn": Case(
        gemm_bn,
        {"Gemm": 1},
        "p",
        Perturb(training, None, note="training_mode=1"),
        Perturb(set_shape("a", None), "not 2-D"),
        NO_GATE,
    ),
    "pad-into-consumer": Case(
        lambda: padded("Conv", [0, 0, 1, 2, 0, 0, 2, 1]),
        {"Conv": 1},
        "p",
        Perturb(set_attr("p", mode="reflect"), "not a constant-mode Pad"),
        Perturb(set_shape("x", None), "the padded rank is unknown"),
        NO_GATE,
    ),
    "conv-branches": Case(
        conv_branches,
        {"Conv": 1},
        "c1",
        Perturb(
            lambda p: set_attr("c1", pads=[1, 1, 0, 0])(set_const("w1", weights(4, 4, 2, 2))(p)),
            "odd number of taps",
            note="a 2x2 kernel beside the 3x3",
        ),
        Perturb(set_shape("x", None), "do not provably have one shape"),
        NO_GATE,
    ),
}

EXPORTED: dict[str, Exported | str] = {
    "conv-branches": "n/a: no exporter fixture has parallel conv branches (timm's FastViT: benchmarks, not fixtures)",
    "mul-conv": Exported(
        ("poolformer_dynamo", "poolformer_ts"),
        {"Mul": 1, "Conv": 2},  # the second norm's gamma gone into the MLP's first Conv
        constant_at("c", _per_row_of_channels, "not per input channel", "gamma (C, 8, 1), varying along H"),
        untyped_at(("x",), "the input's rank is unknown"),
        NO_GATE,
        {"fuse_late": True},
    ),
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "conv-add",
        "conv-bn",
        "conv-mul",
        "conv-sub",
        "gemm-bn",
        "ort-fusedconv",
        "ort-fusedconv-sum",
        "pad-into-consumer",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_depthwise_branches_and_a_subtracted_norm_become_one_conv() -> None:
    """FastViT's RepMixer: depthwise 3x3 and 1x1 branches, the BatchNormalization of x subtracted: one Conv, the
    identity kernel on each channel's own input; the dynamo exporter spells auto_pad NOTSET out."""
    proto = set_attr("c3", auto_pad="NOTSET")(conv_branches(depthwise=True, combine="Sub"))
    fires(proto, "conv-branches", {"Conv": 1})


def test_merged_branches_are_no_lost_fusion_to_the_runtime_guard(tmp_path: Path) -> None:
    """Fewer Convs mean fewer NCHWc and FusedConv kernels in onnxruntime's graph: the guard keeps the merge
    and reports nothing lost (it undid the rule, or warned of losses no rewrite explained)."""
    source, out, report = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(conv_branches(), source)
    result = invoke("run", source, "-o", out, "--report", report)
    assert result.exit_code == 0 and "lost" not in result.stderr, result.stderr
    assert json.loads(report.read_text())["runtime_guard"]["status"] == "kept"
    assert ops(onnx.load(out))["Conv"] == 1
