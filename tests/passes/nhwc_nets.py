"""NHWC networks as tf2onnx writes them, for the unwind pass's tests and measurements.

tf2onnx keeps a Keras model's activations NHWC and wraps every Conv in a Transpose pair
(NHWC -> NCHW before, back after); the ops between two Convs (ZeroPadding2D's Pad,
UpSampling2D's Resize, the skip Concat, ...) read NHWC axes and NHWC per-axis constants.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


class NhwcNet:
    """A graph under construction: ``conv`` takes and gives NHWC values (a Transpose pair
    around an NCHW Conv), ``op`` adds any node with NHWC semantics."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def fresh(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.fresh(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs: object) -> str | list[str]:
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.fresh(op_type), **attrs))
        return names[0] if outputs == 1 else names

    def one(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        made = self.op(op_type, inputs, **attrs)
        assert isinstance(made, str)
        return made

    def conv(
        self, x: str, cin: int, cout: int, k: int = 3, stride: int = 1, pad: int | None = None, group: int = 1
    ) -> str:
        """An NHWC Conv as tf2onnx writes it; ``pad`` None is 'same' padding."""
        w = self.const((self.rng.standard_normal((cout, cin // group, k, k)) / k).astype(np.float32), "kernel")
        bias = self.const((0.1 * self.rng.standard_normal(cout)).astype(np.float32), "bias")
        t = self.one("Transpose", [x], perm=TO_NCHW)
        p = k // 2 if pad is None else pad
        t = self.one("Conv", [t, w, bias], kernel_shape=[k, k], strides=[stride, stride], pads=[p] * 4, group=group)
        return self.one("Transpose", [t], perm=TO_NHWC)

    def relu6(self, x: str) -> str:
        return self.one("Clip", [x, self.const(np.float32(0), "zero"), self.const(np.float32(6), "six")])

    def model(self, x_shape: list[int], outputs: list[tuple[str, list[int]]], opset: int = 18) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def zero_padding(net: NhwcNet, x: str) -> str:
    """Keras ZeroPadding2D(((0, 1), (0, 1))) on an NHWC value: pads [N, H, W, C] begins, ends."""
    return net.one("Pad", [x, net.const(np.array([0, 0, 0, 0, 0, 1, 1, 0], dtype=np.int64), "pads")])


MOBILENET_BLOCKS = ((32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (128, 2))


def mobilenet(blocks: tuple[tuple[int, int], ...] = MOBILENET_BLOCKS, size: int = 32) -> onnx.ModelProto:
    """MobileNet (v1) as tf2onnx writes Keras's: stem Conv, then per block a depthwise Conv
    (strided ones after a ZeroPadding2D Pad and with 'valid' padding) and a pointwise Conv,
    ReLU6 after each; global average pool, dense, softmax."""
    net = NhwcNet("mobilenet_nhwc")
    y = net.relu6(net.conv("input", 3, 16, stride=2))
    c = 16
    for cout, stride in blocks:
        if stride == 2:
            y = net.relu6(net.conv(zero_padding(net, y), c, c, stride=2, pad=0, group=c))
        else:
            y = net.relu6(net.conv(y, c, c, group=c))
        y = net.relu6(net.conv(y, c, cout, k=1))
        c = cout
    y = net.one("ReduceMean", [y, net.const(np.array([1, 2], dtype=np.int64), "axes")], keepdims=0)
    y = net.one("MatMul", [y, net.const(net.rng.standard_normal((c, 10)).astype(np.float32) / 8, "dense")])
    y = net.one("Softmax", [y], axis=-1)
    return net.model(["n", size, size, 3], [(y, ["n", 10])])


def unet(size: int = 16) -> onnx.ModelProto:
    """A UNet in NHWC: two down levels (Pad then strided Conv), two up levels (Resize
    upsampling, Concat with the skip on the channel axis), NHWC output."""
    net = NhwcNet("unet_nhwc", seed=1)
    skips: list[tuple[str, int]] = []
    y, c = net.one("Relu", [net.conv("input", 3, 8)]), 8
    for cout in (16, 32):
        skips.append((y, c))
        y = net.one("Relu", [net.conv(zero_padding(net, y), c, cout, stride=2, pad=0)])
        c = cout
    for skip, cskip in reversed(skips):
        scales = net.const(np.array([1, 2, 2, 1], dtype=np.float32), "scales")
        y = net.one("Resize", [y, "", scales], mode="nearest")
        y = net.one("Concat", [y, skip], axis=3)
        y = net.one("Relu", [net.conv(y, c + cskip, cskip)])
        c = cskip
    y = net.one("Sigmoid", [net.conv(y, c, 2, k=1)])
    return net.model(["n", size, size, 3], [(y, ["n", size, size, 2])])


def squeeze_excite() -> onnx.ModelProto:
    """An EfficientNet-style block in NHWC: ZeroPadding2D and a strided depthwise Conv, a
    squeeze-excite gate (ReduceMean keeping dims, two 1x1 Convs, HardSigmoid, Mul), a
    strided Slice shortcut, bilinear upsampling and a Concat with a tiled constant."""
    net = NhwcNet("squeeze_excite_nhwc", seed=2)

    def ints(*values: int) -> str:
        return net.const(np.array(values, dtype=np.int64), "ints")

    y = net.relu6(net.conv("input", 3, 16, stride=2))
    h = net.relu6(net.conv(zero_padding(net, y), 16, 16, stride=2, pad=0, group=16))
    gate = net.one("ReduceMean", [h, ints(1, 2)], keepdims=1)
    gate = net.one("HardSigmoid", [net.conv(net.one("Relu", [net.conv(gate, 16, 4, k=1)]), 4, 16, k=1)])
    h = net.conv(net.one("Mul", [h, gate]), 16, 16, k=1)
    y = net.one("Add", [h, net.one("Slice", [y, ints(0, 0), ints(16, 16), ints(1, 2), ints(2, 2)])])
    y = net.one("Resize", [y, "", net.const(np.array([1, 2, 2, 1], dtype=np.float32), "scales")], mode="linear")
    side = net.one("Tile", [net.const(np.ones((1, 1, 1, 2), np.float32), "side"), ints(1, 16, 16, 1)])
    y = net.one("Concat", [y, side], axis=3)
    return net.model(["n", 32, 32, 3], [(y, ["n", 16, 16, 18])])
