"""The ``--target ort`` rules (onnxruntime contrib ops, run by its CPU provider in these
tests) and the standard rules added with them: each fires where it should, with numerics
equal in onnxruntime, and not where an extra reader, a graph output, a wrong attribute, an
unprovable shape or the default target forbids it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from tests.passes.fuse_helpers import fires, info, init, model, node, refused

RNG = np.random.default_rng(1)


def _w(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _ort(proto: onnx.ModelProto, rule: str, expected: dict[str, int]) -> onnx.ModelProto:
    out = fires(proto, rule, expected, target="ort")
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    return out


# -- FusedConv ------------------------------------------------------------------------------------


def _conv_act(act: str = "Relu", extra: str = "", residual: bool = False, **attrs: Any) -> onnx.ModelProto:
    inputs = [info("x", ["n", 3, 8, 8])]
    nodes = [node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1])]
    src = "c"
    if residual:
        inputs.append(info("z", ["n", 4, 8, 8] if extra != "broadcast" else [1, 4, 1, 1]))
        nodes.append(node("Add", ["c", "z"], "s"))
        src = "s"
    act_inputs = [src, "lo", "hi"] if act == "Clip" else [src]
    nodes.append(node(act, act_inputs, "y", **attrs))
    outputs: list[Any] = ["y"]
    if extra == "reader":
        nodes.append(node("Neg", ["c"], "r"))
        outputs.append("r")
    elif extra == "output":
        outputs.append("c")
    params = [init("w", _w(4, 3, 3, 3)), init("b", _w(4)), init("lo", 0.0), init("hi", 6.0)]
    return model(nodes, inputs, outputs, params)


@pytest.mark.parametrize(
    ("act", "attrs"),
    [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"alpha": 0.2}), ("Clip", {}), ("HardSigmoid", {})],
)
def test_conv_activation_becomes_fusedconv(act: str, attrs: dict[str, Any]) -> None:
    _ort(_conv_act(act, **attrs), "ort-fusedconv", {"FusedConv": 1})


def test_conv_residual_relu_becomes_fusedconv_with_its_sum_input() -> None:
    _ort(_conv_act(residual=True), "ort-fusedconv-sum", {"FusedConv": 1})


@pytest.mark.parametrize("extra", ["reader", "output"])
def test_fusedconv_refuses_a_conv_read_elsewhere(extra: str) -> None:
    refused(_conv_act(extra=extra), "ort-fusedconv", target="ort")


def test_fusedconv_refusals() -> None:
    details = refused(_conv_act(residual=True, extra="broadcast"), "ort-fusedconv-sum", target="ort")
    assert "not provably the Conv's" in " ".join(details["near_misses"]["conv"])
    refused(_conv_act(), "ort-fusedconv")  # target onnx: standard ops only
    clip = _conv_act("Clip")
    clip.graph.input.append(info("lo", []))
    clip.graph.initializer.pop(2)
    details = refused(clip, "ort-fusedconv", target="ort")
    assert "Clip bounds are not constants" in " ".join(details["near_misses"]["conv"])


# -- FusedMatMul ----------------------------------------------------------------------------------


def _scaled_matmul(op: str = "Div", transpose: bool = True, perm: list[int] | None = None) -> onnx.ModelProto:
    nodes = []
    b = "k"
    if transpose:
        nodes.append(node("Transpose", ["k"], "kt", perm=perm or [0, 2, 1]))
        b = "kt"
    nodes += [node("MatMul", ["q", b], "p"), node(op, ["p", "s"], "y")]
    k_shape = ([4, 2, 5] if perm else [2, 5, 4]) if transpose else [2, 4, 5]
    return model(nodes, [info("q", [2, 3, 4]), info("k", k_shape)], ["y"], [init("s", 8.0)])


def test_scaled_matmul_with_transposed_input_becomes_one_fusedmatmul() -> None:
    out = _ort(_scaled_matmul(), "ort-fusedmatmul-div", {"FusedMatMul": 1})
    (fused,) = out.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fused.attribute}
    assert attrs["transB"] == 1 and attrs["alpha"] == pytest.approx(1 / 8)
    _ort(_scaled_matmul("Mul", transpose=False), "ort-fusedmatmul-mul", {"FusedMatMul": 1})


def test_fusedmatmul_refusals() -> None:
    details = refused(_scaled_matmul(perm=[1, 0, 2]), "ort-transpose-into-matmul-b", target="ort")
    assert "does not swap the last two dims" in " ".join(details["near_misses"]["matmul"])
    refused(_scaled_matmul(), "ort-fusedmatmul-div")
    exposed = _scaled_matmul(transpose=False)
    exposed.graph.output.append(info("p", None))
    refused(exposed, "ort-fusedmatmul-div", target="ort")


# -- standard rules that came with them -----------------------------------------------------------


def _hardswish(opset: int) -> onnx.ModelProto:
    return model(
        [
            node("Add", ["x", "three"], "a"),
            node("Clip", ["a", "lo", "hi"], "c"),
            node("Mul", ["x", "c"], "m"),
            node("Div", ["m", "six"], "y"),
        ],
        [info("x", [2, 5])],
        ["y"],
        [init("three", 3.0), init("lo", 0.0), init("hi", 6.0), init("six", 6.0)],
        opset=opset,
    )


def test_hardswish_below_opset_14_becomes_x_times_hardsigmoid() -> None:
    fires(_hardswish(13), "hardswish-as-hardsigmoid", {"Mul": 1, "HardSigmoid": 1})
    refused(_hardswish(14), "hardswish-as-hardsigmoid")  # HardSwish itself there
    exposed = _hardswish(13)
    exposed.graph.output.append(info("c", None))
    refused(exposed, "hardswish-as-hardsigmoid")


def _computed_reshape(tail: list[int], allowzero: int = 0) -> onnx.ModelProto:
    return model(
        [
            node("Shape", ["x"], "shape"),
            node("Slice", ["shape", "zero", "one"], "batch"),
            node("Concat", ["batch", "tail"], "target", axis=0),
            node("Reshape", ["x", "target"], "y", allowzero=allowzero),
        ],
        [info("x", ["n", 4, 1, 1])],
        ["y"],
        [
            init("zero", np.array([0], np.int64)),
            init("one", np.array([1], np.int64)),
            init("tail", np.array(tail, np.int64)),
        ],
        opset=14,
    )


def test_a_computed_reshape_target_with_one_unknown_entry_becomes_a_constant() -> None:
    fires(_computed_reshape([4]), "reshape-one-unknown", {"Reshape": 1}, passes="shape-infer,fuse,dce")


def test_reshape_one_unknown_refusals() -> None:
    details = refused(_computed_reshape([-1]), "reshape-one-unknown")
    assert "more than one entry" in " ".join(details["near_misses"]["shape"])
    refused(_computed_reshape([4], allowzero=1), "reshape-one-unknown")
