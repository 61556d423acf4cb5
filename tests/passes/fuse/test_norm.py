"""The norm rules' table: LayerNorm, RMSNorm, GroupNorm, Softmax and the skip norms. Each rule fires on its model and
refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its
case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from graphopt.api import optimize
from graphopt.io.onnx_io import from_proto
from graphopt.io.onnx_write import to_proto
from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse.table import (
    F16,
    LATE,
    NO_GATE,
    RNG,
    Case,
    Exported,
    Perturb,
    at_opset,
    attr_at,
    below,
    constant_at,
    copied,
    float32_case,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    target_opset,
    truncated,
    untyped_at,
    weights,
)
from tests.passes.fuse_helpers import fires, fires_ort, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    exported_group_norm,
    group_norm,
    keras_layer_norm,
    layer_norm,
    rand_weight,
    skip_norm,
)

F16_NUMPY = {F16: np.float16, TensorProto.FLOAT: np.float32}


def _float16_rms_norm(elem_type: int = F16) -> onnx.ModelProto:
    """RMSNormalization of a float16 x by a float16 gamma (opset 23): what rmsnorm writes on a float16 Llama."""
    gamma = init("gamma", (RNG.standard_normal(16) * 0.5 + 1).astype(F16_NUMPY[elem_type]))
    return model(
        [node("RMSNormalization", ["x", "gamma"], "y", axis=-1, epsilon=1e-6)],
        [info("x", [2, 3, 16], elem_type)],
        [info("y", None, elem_type)],
        [gamma],
        opset=23,
    )


def _float16_simplified_norm(elem_type: int = F16) -> onnx.ModelProto:
    """onnxruntime's SimplifiedLayerNormalization of a float16 x by a float16 gamma: what ort-rmsnorm writes on a
    float16 decoder for --target ort."""
    proto = _float16_rms_norm(elem_type)
    proto.graph.node[0].op_type = "SimplifiedLayerNormalization"
    return proto


def _rms_round_trip() -> onnx.ModelProto:
    """Hugging Face's RMSNorm of a float16 x as the TorchScript exporter writes it: Cast to float32,
    Pow / ReduceMean / Add / Sqrt / Div(1, .) / Mul, Cast back, times gamma."""
    nodes = [
        node("Cast", ["x"], "xf", to=TensorProto.FLOAT),
        node("Pow", ["xf", "two"], "sq"),
        node("ReduceMean", ["sq", "axes"], "ms", keepdims=1),
        node("Add", ["ms", "eps"], "mse"),
        node("Sqrt", ["mse"], "rms"),
        node("Div", ["one", "rms"], "inv"),
        node("Mul", ["xf", "inv"], "n"),
        node("Cast", ["n"], "n16", to=F16),
        node("Mul", ["gamma", "n16"], "y"),
    ]
    # its own draw: from the shared RNG the weights depended on which tests ran before, and with some the refused
    # "output" case's other fusions moved one float16 output by one ulp, past the table's 1e-4
    gamma = (1 + 0.1 * np.random.default_rng(0).standard_normal(8)).astype(np.float16)
    constants = [init("two", 2.0), init("axes", np.array([-1], np.int64)), init("eps", 1e-6), init("one", 1.0)]
    inputs, outputs = [info("x", ["b", "s", 8], F16)], [info("y", ["b", "s", 8], F16)]
    return model(nodes, inputs, outputs, [*constants, init("gamma", gamma)], opset=23)


def _rmsnorm() -> onnx.ModelProto:
    return model(
        [
            node("Mul", ["x", "x"], "sq"),
            node("ReduceMean", ["sq", "axes"], "ms"),
            node("Add", ["ms", "eps"], "me"),
            node("Sqrt", ["me"], "r"),
            node("Div", ["x", "r"], "n"),
            node("Mul", ["gamma", "n"], "y"),
        ],
        [info("x", ["b", 8])],
        ["y"],
        [init("axes", np.array([-1], np.int64)), init("eps", 1e-6), init("gamma", weights(8))],
        opset=23,
    )


def _softmax(stable: bool, opset: int = 13) -> onnx.ModelProto:
    nodes = [node("ReduceMax", ["x"], "mx", axes=[1]), node("Sub", ["x", "mx"], "d")] if stable else []
    nodes.append(node("Exp", ["d" if stable else "x"], "e"))
    sums = node("ReduceSum", ["e", "axes"], "s") if opset >= 13 else node("ReduceSum", ["e"], "s", axes=[1])
    nodes += [sums, node("Div", ["e", "s"], "y")]
    params = [init("axes", np.array([1], np.int64))] if opset >= 13 else []
    return model(nodes, [info("x", [6, 6])], ["y"], params, opset=opset)


def _one_sample(proto: onnx.ModelProto) -> Mapping[str, np.ndarray]:
    """x of batch 1: the only batch a merge Reshape to Shape(x, start=1) takes."""
    return {"x": weights(1, 6, 4, 5)}


def _skip_case(norm: str, interior: str) -> Case:
    op_type = "SkipLayerNormalization" if norm == "LayerNormalization" else "SkipSimplifiedLayerNormalization"
    axis: Perturb | str = (
        Perturb(set_attr("y", axis=1), "not over the last axis")
        if norm != "decomposed"
        else Perturb(set_attr("ms", axes=[1]), "trailing axes")
    )
    return Case(
        lambda: skip_norm(norm),
        {"MatMul": 1, op_type: 1},
        interior,
        axis,
        Perturb(set_shape("skip", None), "do not provably have one" if norm != "decomposed" else "known float type"),
        NO_GATE,
        {"target": "ort", "enable": ["norm"]},
    )


def _constant_skip(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The residual's ``skip`` operand a constant (a bias, to the rule) instead of an input."""
    out = copied(proto)
    kept = [i for i in out.graph.input if i.name != "skip"]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.append(init("skip", weights(1, 3, 8)))
    return out


RESIDUAL_SUM = Case(
    skip_norm,
    {"MatMul": 1, "Add": 1, "Sum": 1, "LayerNormalization": 1},
    "sum",
    Perturb(_constant_skip, "an operand is a constant", feeds=make_feeds, note="skip a constant"),
    Perturb(set_shape("skip", None), "do not provably have one 3-D float shape"),
    NO_GATE,
)


EXPORTED_SUM = (
    "n/a: the residual sum is exported (the fused op's 4th output) and a read bias Add leaves the bias out "
    "(test_a_residual_read_further_on_comes_from_the_fourth_output)"
)


def _per_channel_and_row(values: np.ndarray) -> np.ndarray:
    """A (C, 1, 1) gamma made to vary along the 16 rows of the unet fixture's latents too."""
    rows = np.linspace(0.5, 1.5, 16, dtype=values.dtype).reshape(1, 16, 1)
    return (values * rows).astype(values.dtype)


def _per_row(values: np.ndarray) -> np.ndarray:
    """A (1, 1, C) scale made to vary along the 6 rows of make_keras.py's (batch, 6, C) features."""
    rows = np.linspace(0.5, 1.5, 6, dtype=values.dtype).reshape(1, 6, 1)
    return (np.broadcast_to(values, (1, 6, values.shape[-1])) * rows).astype(values.dtype)


def _per_channel(values: np.ndarray) -> np.ndarray:
    return np.full(32, values.item(), values.dtype)  # the fixtures' hidden size (make.py's H)


ORT_DEFAULT_DOMAIN = "n/a: no opset gate (onnxruntime registers SimplifiedLayerNormalization at any opset)"


# GroupNormalization is written only where the run names its target opset (onnxruntime's CPU runs the op's function
# body, slower than the spelling): the cases name the opset they are built at.
_NAMED_OPSET = {"target_opset": 21}
_DECOMPOSED_BELOW_18 = (
    "at opsets 18 to 20 groupnorm-18 takes it (opset 18's per-group GroupNormalization), and below 18 the "
    "decomposed spelling's ReduceMean has no axes input"
)

CASES: dict[str, Case] = {
    **{
        name: Case(
            build,
            {"LayerNormalization": 1},
            "mean",
            Perturb(set_attr("mean", "var", axes=[1]), "trailing axes"),
            Perturb(set_shape("x", ["b", 3, "h"]), "normalized dims are not static"),
            below(17),
        )
        for name, build in (
            ("layernorm", layer_norm),
            ("layernorm-no-bias", truncated(layer_norm, "g")),
            ("layernorm-plain", truncated(layer_norm, "n")),
        )
    },
    **{
        name: Case(
            build,
            {"RMSNormalization": 1},
            "ms",
            Perturb(set_const("axes", [0]), "trailing axes", note="the axes input"),
            Perturb(set_shape("x", ["b", "h"]), "normalized dims are not static"),
            below(23),
        )
        for name, build in (("rmsnorm", _rmsnorm), ("rmsnorm-plain", truncated(_rmsnorm, "n")))
    },
    # --target ort, at an opset below RMSNormalization's: onnxruntime's SimplifiedLayerNormalization
    **{
        name: Case(
            lambda build=build: at_opset(18)(build()),
            {"SimplifiedLayerNormalization": 1},
            "ms",
            Perturb(set_const("axes", [0]), "trailing axes", note="the axes input"),
            Perturb(set_shape("x", ["b", "h"]), "normalized dims are not static"),
            NO_GATE,
            {"target": "ort"},
        )
        for name, build in (("ort-rmsnorm", _rmsnorm), ("ort-rmsnorm-plain", truncated(_rmsnorm, "n")))
    },
    "ort-rmsnorm-round-trip": Case(
        lambda: at_opset(18)(_rms_round_trip()),
        {"SimplifiedLayerNormalization": 1},
        "n",
        Perturb(set_const("eps", np.full(8, 1e-6)), "epsilon is not a scalar", note="a constant: eps per channel"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        NO_GATE,
        {"target": "ort"},
    ),
    "rmsnorm-round-trip": Case(
        _rms_round_trip,
        {"RMSNormalization": 1},
        "n",
        Perturb(set_const("eps", np.full(8, 1e-6)), "epsilon is not a scalar", note="a constant: eps per channel"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        below(23),
    ),
    **{
        name: Case(
            build,
            {"GroupNormalization": 1},
            "grouped",
            # the merge Reshape drops the batch axis: x's shape is no longer restored
            Perturb(set_attr("x_shape", start=1), "not provably back to x's shape", _one_sample, "Shape(x) start=1"),
            Perturb(set_shape("x", ["b", "c", "h", 5]), "the channel dim is not static"),
            low,
            settings=_NAMED_OPSET,
        )
        for name, build, low in (
            # below opset 18's per-group GroupNormalization too (groupnorm-18's, at 18 to 20)
            ("groupnorm", group_norm, Perturb(at_opset(17), "needs opset >= 21", settings={"target_opset": 17})),
            ("groupnorm-no-bias", truncated(lambda: group_norm("decomposed"), "scaled"), _DECOMPOSED_BELOW_18),
            # two dynamic dims: reshape-one-unknown cannot take the root, which would hide the near miss
            (
                "groupnorm-plain",
                truncated(lambda: set_shape("x", ["b", 6, "h", 5])(group_norm("decomposed")), "merged"),
                _DECOMPOSED_BELOW_18,
            ),
        )
    },
    # opset 18's per-group GroupNormalization at 18 to 20: the fixtures' per-channel gamma and beta stay after it
    **{
        name: Case(
            lambda build=build: at_opset(20)(build()),
            expected,
            "grouped",
            Perturb(set_attr("x_shape", start=1), "not provably back to x's shape", _one_sample, "Shape(x) start=1"),
            Perturb(set_shape("x", ["b", "c", "h", 5]), "the channel dim is not static"),
            low,
            settings={"target_opset": 20},
        )
        for name, build, expected, low in (
            (
                "groupnorm-18",
                group_norm,
                {"GroupNormalization": 1, "Mul": 1, "Add": 1},
                Perturb(at_opset(17), "needs opset >= 18", settings={"target_opset": 17}),
            ),
            (
                "groupnorm-18-no-bias",
                truncated(lambda: group_norm("decomposed"), "scaled"),
                {"GroupNormalization": 1, "Mul": 1},
                "below 18 the decomposed spelling's ReduceMean has no axes input",
            ),
            (
                "groupnorm-18-plain",
                truncated(lambda: set_shape("x", ["b", 6, "h", 5])(group_norm("decomposed")), "merged"),
                {"GroupNormalization": 1},
                "below 18 the decomposed spelling's ReduceMean has no axes input",
            ),
        )
    },
    **{
        name: Case(
            lambda stable=stable: _softmax(stable),
            {"Softmax": 1},
            "s",
            Perturb(set_attr("s", keepdims=0), "with keepdims"),
            Perturb(set_shape("x", None), "known float type and rank"),
            Perturb(lambda p, stable=stable: _softmax(stable, opset=12), "needs opset >= 13"),
        )
        for name, stable in (("softmax", True), ("softmax-unstable", False))
    },
    "ort-skiplayernorm": _skip_case("LayerNormalization", EXPORTED_SUM),
    "layernorm-residual-sum": RESIDUAL_SUM,
    "layernorm-tf": Case(
        keras_layer_norm,
        {"LayerNormalization": 1},
        "inv",
        Perturb(set_const("gamma", weights(3, 1)), "varies along axes that are not normalized", note="gamma per row"),
        Perturb(set_shape("x", None), "no known float type and rank"),
        below(17),
    ),
    "ort-skiprmsnorm": _skip_case("RMSNormalization", EXPORTED_SUM),
    "ort-skiprmsnorm-decomposed": _skip_case("decomposed", "ms"),
    "rmsnorm-float32": float32_case(
        _float16_rms_norm,
        "RMSNormalization",
        3,
        "n/a: the rule's root is an RMSNormalization, which no opset below 23 has",
        LATE,
    ),
    "ort-rmsnorm-float32": float32_case(
        _float16_simplified_norm,
        "SimplifiedLayerNormalization",
        3,
        "n/a: onnxruntime registers SimplifiedLayerNormalization at every opset",
        {"target": "ort", **LATE},
    ),
}

EXPORTED: dict[str, Exported | str] = {
    "rmsnorm-float32": "its case is what rmsnorm writes on a float16 export; test_float32.py runs the whole pipeline "
    "on the float16 Llama export (tests/fixtures/exports/llama_fp16_dynamo.onnx)",
    "ort-rmsnorm-float32": "as rmsnorm-float32, at --target ort",
    "groupnorm": Exported(
        ("unet_dynamo", "unet_ts"),
        {"GroupNormalization": 1},
        constant_at("gamma", _per_channel_and_row, "gamma is not per channel", "gamma (C, 16, 1), per row too"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(17, "needs opset >= 21", "below opset 18's per-group GroupNormalization too"),
        {"target_opset": 23},
    ),
    "groupnorm-18": Exported(
        ("unet_dynamo", "unet_ts"),
        {"GroupNormalization": 1, "Mul": 1, "Add": 1},
        constant_at("gamma", _per_channel_and_row, "gamma is not per channel", "gamma (C, 16, 1), per row too"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(17, "needs opset >= 18"),
        {"target_opset": 20},
    ),
    "groupnorm-18-no-bias": "n/a: the exporters write nn.GroupNorm with its bias (groupnorm-18's case)",
    "groupnorm-18-plain": "n/a: the exporters write nn.GroupNorm with its affine (groupnorm-18's case)",
    "layernorm-residual-sum": Exported(
        ("gpt2_dynamo", "gpt2_ts"),
        {"Sum": 1, "LayerNormalization": 5},
        attr_at("ln", "last axis", axis=1),
        untyped_at(("skip",), "do not provably have one 3-D float shape"),
        NO_GATE,
    ),
    "layernorm-tf": Exported(
        ("keras_layernorm",),
        {"LayerNormalization": 1},
        constant_at("gamma", _per_row, "varies along axes that are not normalized", "gamma (1, 6, C), per row"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(16, None, "LayerNormalization came in 17; the rule is not tried"),
    ),
    "ort-rmsnorm": Exported(
        ("llama_dynamo",),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "ort-rmsnorm-plain": Exported(
        ("llama_ts",),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "ort-rmsnorm-round-trip": Exported(
        ("llama_fp16_dynamo", "llama_fp16_ts"),
        {"SimplifiedLayerNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        ORT_DEFAULT_DOMAIN,
        {"target": "ort"},
    ),
    "rmsnorm-round-trip": Exported(
        ("llama_fp16_ts", "llama_fp16_dynamo"),
        {"RMSNormalization": 1},
        constant_at("eps", _per_channel, "epsilon is not a scalar", "epsilon per channel"),
        untyped_at(("x",), "no known float type and rank"),
        target_opset(22, "needs opset >= 23"),
        {"target_opset": 23},
    ),
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "groupnorm-no-bias",
        "groupnorm-plain",
        "layernorm",
        "layernorm-no-bias",
        "layernorm-plain",
        "ort-skiplayernorm",
        "ort-skiprmsnorm",
        "ort-skiprmsnorm-decomposed",
        "rmsnorm",
        "rmsnorm-plain",
        "softmax",
        "softmax-unstable",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


# -- GroupNorm as the exporters write it (diffusers' UNets and VAEs) ----------------------------------------------


def _group_norm_runs(proto: onnx.ModelProto, **settings: object) -> tuple[onnx.ModelProto, dict]:
    """The default pipeline on ``proto`` (whose shape rules fold Shape(x) where only the batch is dynamic), without
    the runtime guard (onnxruntime 1.32 runs opset 24's Swish decomposed: the guard undoes swish); the result and
    the fuse runs' details."""
    result = optimize(from_proto(proto), strict=True, **settings, check=False, runtime_guard=False)  # type: ignore[arg-type]
    misses = [m for run in result.report["passes"] if run["pass"] == "fuse" for m in _norm_misses(run)]
    return to_proto(result.model), {"near_misses": misses}


def _norm_misses(run: dict) -> list[str]:
    return list(run["details"]["near_misses"].get("norm", {}).get("examples", []))


def _same_at_two_sizes(original: onnx.ModelProto, out: onnx.ModelProto, tolerance: float = 1e-4) -> None:
    """Equal outputs at batch 1 and 3, the dynamic spatial dims at two sizes."""
    declared = [d.dim_value or d.dim_param or None for d in original.graph.input[0].type.tensor_type.shape.dim]
    elem = onnx.helper.tensor_dtype_to_np_dtype(original.graph.input[0].type.tensor_type.elem_type)
    for batch, grow in ((1, 1), (3, 2)):
        shape = [d if isinstance(d, int) else batch if i == 0 else (4 + 2 * i) * grow for i, d in enumerate(declared)]
        feeds = {"x": RNG.standard_normal(shape).astype(elem)}
        assert_same_outputs(original, out, feeds, rtol=tolerance, atol=tolerance)


def _counts(proto: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in proto.graph.node)


SPELLINGS = {
    # TorchScript, batch dynamic, spatial static: the pipeline folds Shape(x) to [0, 32, 4, 6]
    "ts-batch": ("zero", "shape", ("batch", 32, 4, 6)),
    "ts-dynamic": ("zero", "shape", ("batch", 32, "h", "w")),
    "dynamo-batch": ("zero", "shape-start", ("batch", 32, 4, 6)),
    "dynamo-static-batch": ("static", "shape-start", (2, 32, "h", "w")),
    "copied-batch": ("zero", "zero", ("batch", 32, 4, 6)),
    "inferred-batch": ("zero", "inferred", ("batch", 32, 4, 6)),
    "read": ("read", "gathered", ("batch", 32, "h", "w")),
    "read-batch": ("read", "gathered", ("batch", 32, 4, 6)),
    # dims no one named: only Shape(x) itself proves them
    "unnamed-dims": ("zero", "shape", (None, 32, None, None)),
    "rank-3": ("zero", "shape-start", ("batch", 32, 10)),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_exported_group_norm_becomes_group_normalization(spelling: str) -> None:
    split, back, dims = SPELLINGS[spelling]
    original = exported_group_norm(split, back, dims)
    out, details = _group_norm_runs(original, target_opset=23)
    assert _counts(out) == {"GroupNormalization": 1}, (_counts(out), details)
    (fused,) = out.graph.node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in fused.attribute}
    assert attributes["num_groups"] == 8 and attributes["epsilon"] == pytest.approx(1e-6)
    _same_at_two_sizes(original, out)


def test_group_norm_before_silu_fuses_the_norm() -> None:
    original = exported_group_norm(dims=("batch", 32, 4, 6), silu=True)
    out, _ = _group_norm_runs(original, target_opset=23)
    assert _counts(out) == {"GroupNormalization": 1, "Sigmoid": 1, "Mul": 1}
    _same_at_two_sizes(original, out)
    out, _ = _group_norm_runs(original, target_opset=24)
    assert _counts(out) == {"GroupNormalization": 1, "Swish": 1}


def test_float16_group_norm_fuses_with_float16_weights() -> None:
    original = exported_group_norm(dims=("batch", 32, "h", "w"), elem_type=F16)
    out, _ = _group_norm_runs(original, target_opset=23)
    assert _counts(out) == {"GroupNormalization": 1}
    weights_of = {t.name: t for t in out.graph.initializer}
    assert all(weights_of[name].data_type == F16 for name in out.graph.node[0].input[1:])
    _same_at_two_sizes(original, out, tolerance=4e-3)


def test_group_norm_keeps_a_non_trivial_instance_norm_scale() -> None:
    # gamma_c * (s_g * n + 0) + beta_c: the scale of each group goes into its channels' scale
    original = exported_group_norm(in_scale=np.linspace(0.5, 2.0, 8).astype(np.float32))
    out, _ = _group_norm_runs(original, target_opset=23)
    assert _counts(out) == {"GroupNormalization": 1}
    _same_at_two_sizes(original, out)


def test_target_ort_keeps_the_instance_norm_decomposition() -> None:
    # onnxruntime's CPU runs GroupNormalization as its function body and has no com.microsoft GroupNorm kernel
    original = exported_group_norm(dims=("batch", 32, "h", "w"))
    out, _ = _group_norm_runs(original, target="ort", target_opset=23)
    assert _counts(out)["InstanceNormalization"] == 1 and "GroupNormalization" not in _counts(out)
    _same_at_two_sizes(original, out)


GROUP_NORM_REFUSALS = {
    "merge to [0, C, W, H]": (exported_group_norm(back="swapped"), "not provably back to x's shape"),
    "merge to [0, C, -1]": (exported_group_norm(back="flat"), "not provably back to x's shape"),
    # 30 * 4 * 6 elements split in 8 groups: each group takes channels in part
    "30 channels, 8 groups": (exported_group_norm(dims=("batch", 30, 4, 6)), "G dividing the channels"),
}


def test_group_norm_with_a_gamma_not_per_channel_keeps_its_mul_and_add() -> None:
    original = exported_group_norm(gamma=1 + 0.1 * weights(32, 4, 1))
    out, details = _group_norm_runs(original, target_opset=23)
    # groupnorm-plain takes the norm; the scale over (C, H) and the shift stay
    assert _counts(out) == {"GroupNormalization": 1, "Mul": 1, "Add": 1}
    assert any("gamma is not per channel" in miss for miss in details["near_misses"]), details
    _same_at_two_sizes(original, out)


@pytest.mark.parametrize("case", list(GROUP_NORM_REFUSALS))
def test_group_norm_refusals(case: str) -> None:
    original, reason = GROUP_NORM_REFUSALS[case]
    out, details = _group_norm_runs(original, target_opset=23)
    assert "GroupNormalization" not in _counts(out)
    assert any(reason in miss for miss in details["near_misses"]), details
    _same_at_two_sizes(original, out)


def test_group_norm_with_an_instance_norm_scale_of_run_time_values_is_refused() -> None:
    original = exported_group_norm()
    scale = next(t for t in original.graph.initializer if t.name == "in_scale")
    original.graph.initializer.remove(scale)
    original.graph.input.append(info("in_scale", [8]))
    out, details = _group_norm_runs(original, target_opset=23)
    assert "GroupNormalization" not in _counts(out)
    assert any("not constants over the groups" in m for m in details["near_misses"]), details


@pytest.mark.parametrize("opset", [18, 20])
@pytest.mark.parametrize(
    ("gamma", "beta", "expected"),
    [
        # the exporter's learned per-channel gamma and beta: a Mul and an Add after opset 18's per-group op
        (None, None, {"GroupNormalization": 1, "Mul": 1, "Add": 1}),
        # gamma constant over each group's channels goes in the op, beta per channel stays an Add after it
        (np.repeat(np.linspace(0.5, 2.0, 8), 4), None, {"GroupNormalization": 1, "Add": 1}),
        # both constant over each group's channels: the op alone
        (np.repeat(np.linspace(0.5, 2.0, 8), 4), np.repeat(np.linspace(-1.0, 1.0, 8), 4), {"GroupNormalization": 1}),
    ],
    ids=["per-channel", "per-group-gamma", "per-group-both"],
)
def test_group_norm_at_opsets_18_to_20_is_the_per_group_op(
    opset: int, gamma: np.ndarray | None, beta: np.ndarray | None, expected: dict[str, int]
) -> None:
    """Opset 18's GroupNormalization takes its scale and bias per group (21 made them per channel): what varies within
    a group stays outside it, equal to the export in onnxruntime."""
    original = exported_group_norm(
        dims=("batch", 32, "h", "w"),
        gamma=None if gamma is None else gamma.reshape(32, 1, 1).astype(np.float32),
        beta=None if beta is None else beta.reshape(32, 1, 1).astype(np.float32),
    )
    out, details = _group_norm_runs(original, target_opset=opset)
    assert _counts(out) == expected, (_counts(out), details)
    (fused,) = [n for n in out.graph.node if n.op_type == "GroupNormalization"]
    assert [list(t.dims) for t in out.graph.initializer if t.name in fused.input[1:]] == [[8], [8]]
    _same_at_two_sizes(original, out)


def test_layernorm_fuses() -> None:
    fires(layer_norm(), "layernorm", {"LayerNormalization": 1})


def test_layernorm_refusals() -> None:
    details = refused(layer_norm(gamma_input=True), "layernorm")
    assert any("gamma is not a constant" in m for m in details["near_misses"]["norm"])
    refused(layer_norm(axes=[1]), "layernorm")
    details = refused(layer_norm(opset=16), "layernorm")
    assert "needs opset >= 17" in " ".join(details["near_misses"]["norm"])


@pytest.mark.parametrize(("mean", "rank"), [("GlobalAveragePool", 3), ("ReduceMean", 3), ("GlobalAveragePool", 4)])
def test_keras_layernorm_from_tf2onnx_fuses(mean: str, rank: int) -> None:
    # Keras' LayerNormalization as tf2onnx writes it: the means as GlobalAveragePool over
    # axes 2.. (its global pool optimizer), x * inv + (beta - mean * inv).
    out = fires(keras_layer_norm(mean, rank), "layernorm-tf", {"LayerNormalization": 1})
    (ln,) = out.graph.node
    assert onnx.helper.get_attribute_value(ln.attribute[0]) == 2 - rank  # normalizes axes 2..


@pytest.mark.parametrize("form", ["instance", "decomposed"])
def test_groupnorm_fuses_at_opset_21(form: str) -> None:
    fires(group_norm(form), "groupnorm", {"GroupNormalization": 1}, **_NAMED_OPSET)


def test_groupnorm_takes_a_gamma_broadcast_over_the_channels() -> None:
    fires(group_norm(gamma=np.array(1.5, np.float32)), "groupnorm", {"GroupNormalization": 1}, **_NAMED_OPSET)


@pytest.mark.parametrize("opset", [20, 21])
def test_the_default_target_keeps_the_group_norm_spelling_onnxruntime_runs_faster(opset: int) -> None:
    # A model already at opset 18 or later (the dynamo exporter's UNets) got GroupNormalization at its default target,
    # which onnxruntime's CPU runs as the op's function body: the dynamo UNet fixture's default output ran 1.33x the
    # export. Written only where the run names its target opset.
    original = at_opset(opset)(group_norm("instance"))
    out, details = fuse(original)
    assert "GroupNormalization" not in _counts(out) and _counts(out)["InstanceNormalization"] == 1
    assert any("explicit --target-opset" in miss for miss in details["near_misses"]["norm"]), details
    named, _ = fuse(original, target_opset=opset)
    assert _counts(named)["GroupNormalization"] == 1


def test_groupnorm_refusals() -> None:
    for extra in ("reader", "output"):
        refused(group_norm(extra=extra), "groupnorm")
    details = refused(group_norm("decomposed", axes=[1]), "groupnorm")
    assert "do not reduce the last axis" in " ".join(details["near_misses"]["norm"])
    details = refused(group_norm(channels="c"), "groupnorm")
    assert "channel dim is not static" in " ".join(details["near_misses"]["norm"])
    details = refused(group_norm(groups=4), "groupnorm")  # 4 groups do not divide 6 channels
    assert "G dividing the channels" in " ".join(details["near_misses"]["norm"])
    details = refused(group_norm(gamma=rand_weight(6, 1, 5)), "groupnorm")
    assert "gamma is not per channel" in " ".join(details["near_misses"]["norm"])
    # below 18, where opset 18's per-group GroupNormalization (groupnorm-18's) does not exist either
    details = refused(group_norm(opset=17), "groupnorm-18")
    assert "needs opset >= 18" in " ".join(details["near_misses"]["norm"])


def test_softmax_decomposition_fuses() -> None:
    proto = model(
        [
            node("ReduceMax", ["x"], "mx", axes=[1]),
            node("Sub", ["x", "mx"], "d"),
            node("Exp", ["d"], "e"),
            node("ReduceSum", ["e", "axes"], "s"),
            node("Div", ["e", "s"], "y"),
        ],
        [info("x", [2, 6])],
        ["y"],
        [init("axes", np.array([1], np.int64))],
    )
    fires(proto, "softmax", {"Softmax": 1})


def test_layernorm_of_a_biased_residual_becomes_skiplayernorm() -> None:
    fires_ort(skip_norm(), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})
    fires_ort(skip_norm(bias=False), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1})


def test_a_residual_read_further_on_comes_from_the_fourth_output() -> None:
    out = fires_ort(skip_norm(carry=True), "ort-skiplayernorm", {"MatMul": 1, "SkipLayerNormalization": 1, "Relu": 1})
    skip, relu = out.graph.node[1], out.graph.node[2]
    assert relu.input[0] == skip.output[3]


@pytest.mark.parametrize("norm", ["RMSNormalization", "decomposed"])
def test_rmsnorm_of_a_residual_becomes_skipsimplifiedlayernorm(norm: str) -> None:
    rule = "ort-skiprmsnorm" if norm == "RMSNormalization" else "ort-skiprmsnorm-decomposed"
    fires_ort(skip_norm(norm, carry=True), rule, {"MatMul": 1, "SkipSimplifiedLayerNormalization": 1, "Relu": 1})


def test_an_rmsnorm_whose_residual_is_unprovable_becomes_simplifiedlayernorm_alone() -> None:
    # Below opset 23 onnxruntime's SimplifiedLayerNormalization stands for RMSNormalization; where the skip
    # form is refused (the operands' shapes differ) the residual Add stays in front of it.
    unprovable = skip_norm("decomposed", skip_shape=[1, 3, 8])
    out = fires(unprovable, "ort-rmsnorm", {"MatMul": 1, "Add": 2, "SimplifiedLayerNormalization": 1}, target="ort")
    assert [o.domain for o in out.opset_import] == [""]  # onnxruntime has it in the default domain
    refused(unprovable, "ort-rmsnorm")  # target onnx: the model's opset 17 has no RMS norm at all


def test_skip_norm_refusals() -> None:
    details = refused(skip_norm(skip_shape=[1, 3, 8]), "ort-skiplayernorm", target="ort", enable=["norm"])
    assert "do not provably have one" in " ".join(details["near_misses"]["norm"])
    refused(skip_norm(), "ort-skiplayernorm", enable=["norm"])  # target onnx
    refused(skip_norm(), "ort-skiplayernorm", target="ort")  # off by default: slower in onnxruntime
    exposed = skip_norm()
    exposed.graph.output.append(info("pb", None))
    out, _ = fuse(exposed, target="ort", enable=["norm"])
    assert "Add" in {n.op_type for n in out.graph.node}  # the bias stays outside; the Add is not fused away


def _onnxruntime_ops(proto: onnx.ModelProto, tmp_path: Path) -> Counter[str]:
    """The ops of ``proto`` after onnxruntime's own graph optimizations (extended level)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return ops(onnx.load(options.optimized_model_filepath))


@pytest.mark.parametrize("bias", [True, False])
def test_the_default_output_keeps_a_residual_norm_out_of_onnxruntimes_skiplayernorm(bias: bool, tmp_path: Path) -> None:
    # onnxruntime fuses Add -> LayerNormalization into SkipLayerNormalization wherever it can
    # prove the Add's operands share one 3-D shape (graphopt's static Reshape targets give it
    # that proof on TorchScript exports); on CPU that kernel measured 4-8x slower than the
    # Add and the LayerNormalization it replaces. The default output writes the residual as a
    # two-input Sum, which onnxruntime runs as fast and does not fuse.
    proto = skip_norm(bias=bias)
    assert _onnxruntime_ops(proto, tmp_path)["SkipLayerNormalization"] == 1  # the form it fuses
    expected = {"MatMul": 1, "Sum": 1, "LayerNormalization": 1} | ({"Add": 1} if bias else {})
    out = fires(proto, "layernorm-residual-sum", expected)
    assert _onnxruntime_ops(out, tmp_path)["SkipLayerNormalization"] == 0


def _post_norm_block() -> onnx.ModelProto:
    """BERT's post-norm block: LayerNorm -> projection -> residual Add -> LayerNorm."""
    nodes = [
        node("LayerNormalization", ["x", "gamma", "beta"], "h", epsilon=1e-5),
        node("MatMul", ["h", "w"], "p"),
        node("Add", ["p", "h"], "sum"),
        node("LayerNormalization", ["sum", "gamma", "beta"], "y", epsilon=1e-5),
    ]
    params = [init("w", rand_weight(8, 8)), init("gamma", rand_weight(8)), init("beta", rand_weight(8))]
    return model(nodes, [info("x", ["b", 3, 8])], ["y"], params)


def _embeddings() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """BERT's embeddings: the word and position lookups' sum -> LayerNorm."""
    nodes = [
        node("Gather", ["words", "ids"], "word"),
        node("Gather", ["positions", "position_ids"], "position"),
        node("Add", ["word", "position"], "sum"),
        node("LayerNormalization", ["sum", "gamma", "beta"], "y", epsilon=1e-5),
    ]
    params = [init(name, rand_weight(*shape)) for name, shape in (("words", (50, 8)), ("positions", (16, 8)))]
    params += [init("gamma", rand_weight(8)), init("beta", rand_weight(8))]
    ids = [info(name, ["b", 6], TensorProto.INT64) for name in ("ids", "position_ids")]
    feeds = {name: RNG.integers(0, 16, (2, 6)) for name in ("ids", "position_ids")}
    return model(nodes, ids, ["y"], params), feeds


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("block", ["post-norm", "embeddings"])
def test_a_residual_from_a_norm_or_a_lookup_is_kept_out_of_onnxruntimes_skiplayernorm(
    block: str, target: str, tmp_path: Path
) -> None:
    # onnxruntime's attention and embedding fusions read these Adds only in older BERT exports (on none of
    # the exports measured), while it fused them into its slower SkipLayerNormalization wherever it proved
    # the shapes: a post-norm RoBERTa's default output had all nine norms so (1.04x the export).
    proto, feeds = (_post_norm_block(), None) if block == "post-norm" else _embeddings()
    assert _onnxruntime_ops(proto, tmp_path)["SkipLayerNormalization"] == 1
    rest = {"LayerNormalization": 2, "MatMul": 1} if block == "post-norm" else {"Gather": 2, "LayerNormalization": 1}
    out = fires(proto, "layernorm-residual-sum", rest | {"Sum": 1}, feeds, target=target)
    assert _onnxruntime_ops(out, tmp_path)["SkipLayerNormalization"] == 0
