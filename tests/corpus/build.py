"""The test corpus: seven deterministic ONNX models in the styles real exporters write.

    .venv/bin/python tests/corpus/build.py --out DIR                # all seven (about 200 MB, a few seconds)
    .venv/bin/python tests/corpus/build.py --out DIR --only bert_small,wide_ensemble

The tests build it once per machine through the ``corpus_dir`` fixture (tests/conftest.py); nothing is
downloaded and no file is committed. Every model has seeded random weights, so two builds are
byte-identical. The styles follow what torch.onnx.export (TorchScript exporter, opset 17) and tf2onnx emit:
shape plumbing with Shape / Gather / Unsqueeze / Concat, decomposed LayerNorm and GELU, Conv +
BatchNormalization pairs, scalar Constant nodes, NHWC models wrapped in Transpose pairs, float16 weights cast
at run time. The models are those of the workspace's corpus builder (../shared/corpus/build.py), byte for
byte, so the node counts the tests pin hold for both.

- resnet50: ResNet-50 v1.5, torch export style, Conv without bias + BatchNormalization + Relu, 102 MB (Conv+BN
  fusion, big initializers, load and save speed);
- inception_v1: GoogLeNet, model-zoo style, Conv with bias, LRN, Dropout (parallel 1x1 Convs reading one input
  for fold, Dropout removal);
- tf_style_nhwc: a Keras ResNet-style CNN as tf2onnx writes it, NHWC activations with a Transpose pair around
  every Conv and MaxPool (unwind, Transpose elimination);
- bert_small: BERT encoder, 4 layers, hidden 256, TorchScript export style, dynamic batch and sequence (symbolic
  shape folding, LayerNorm / GELU fusion, the Q/K/V fold, attention);
- bert_fp16_weights: the same with float16 weights, each Cast to float32 at run time (size guards, CachedSession);
- gpt2_small: GPT-2 decoder, 4 layers, fused c_attn + Split, tanh GELU, a causal mask sliced from a buffer,
  lm_head tied to wte through a Transpose (Where / Slice shape logic, tied weights, Range);
- wide_ensemble: eight 3-layer MLPs on eight inputs, averaged (the stacked fold across branches).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class Builder:
    """Appends nodes in export style: scoped node names, `<name>_output_<i>` value names."""

    def __init__(self, name: str, seed: int, producer: tuple[str, str] = ("pytorch", "2.5.1")) -> None:
        self.name = name
        self.producer = producer
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.scope: list[str] = []
        self.counts: dict[str, int] = {}
        self.const_count = 0

    # names
    def _node_name(self, op: str) -> str:
        base = "/" + "/".join([*self.scope, op])
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def push(self, *parts: str) -> Builder:
        self.scope.extend(parts)
        return self

    def pop(self, n: int = 1) -> None:
        del self.scope[-n:]

    # graph pieces
    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value: str, name: str, elem: int, shape: list) -> None:
        self.op("Identity", [value], outputs=[name])
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def weight(self, name: str, shape: tuple, scale: float | None = None, dtype=np.float32, value=None) -> str:
        if value is None:
            fan_in = shape[1] if len(shape) == 2 else int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
            s = scale if scale is not None else 1.0 / math.sqrt(max(fan_in, 1))
            value = self.rng.standard_normal(shape, dtype=np.float32) * s
        self.inits.append(numpy_helper.from_array(np.asarray(value).astype(dtype), name))
        return name

    def const(self, value, dtype=None) -> str:
        arr = np.array(value, dtype=dtype) if dtype is not None else np.array(value)
        name = self._node_name("Constant")
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node("Constant", [], [out], name=name, value=numpy_helper.from_array(arr)))
        return out

    def op(
        self,
        op_type: str,
        inputs: list[str],
        n_out: int = 1,
        outputs: list[str] | None = None,
        domain: str = "",
        **attrs,
    ) -> str:
        name = self._node_name(op_type)
        outs = outputs or [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs  # type: ignore[return-value]

    def model(self, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name=self.producer[0],
            producer_version=self.producer[1],
            doc_string=doc,
        )
        m.ir_version = 8
        return m


# ---------------------------------------------------------------- CNNs


def conv_bn_relu(b: Builder, x: str, cin: int, cout: int, k: int, stride: int, prefix: str, relu: bool = True) -> str:
    w = b.weight(f"{prefix}.conv.weight", (cout, cin, k, k), scale=math.sqrt(2.0 / (cin * k * k)))
    y = b.op(
        "Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, dilations=[1, 1], group=1
    )
    g0 = 1.0 if relu else 0.2  # damped residual branches keep activations O(1) through 16 blocks
    gamma = b.weight(f"{prefix}.bn.weight", (cout,), value=g0 + 0.1 * g0 * b.rng.standard_normal(cout))
    beta = b.weight(f"{prefix}.bn.bias", (cout,), value=0.1 * b.rng.standard_normal(cout))
    mean = b.weight(f"{prefix}.bn.running_mean", (cout,), value=0.1 * b.rng.standard_normal(cout))
    var = b.weight(f"{prefix}.bn.running_var", (cout,), value=1.0 + 0.1 * b.rng.random(cout))
    y = b.op("BatchNormalization", [y, gamma, beta, mean, var], epsilon=1e-5, momentum=0.9)
    return b.op("Relu", [y]) if relu else y


def resnet50() -> onnx.ModelProto:
    b = Builder("resnet50", seed=50)
    x = b.input("input", TensorProto.FLOAT, ["batch", 3, 224, 224])
    b.push("conv1")
    y = conv_bn_relu(b, x, 3, 64, 7, 2, "conv1")
    b.pop()
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)], start=1):
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 1) else 1
            p = f"layer{stage}.{i}"
            b.push(f"layer{stage}", str(i))
            h = conv_bn_relu(b, y, cin, width, 1, 1, f"{p}.1")
            h = conv_bn_relu(b, h, width, width, 3, stride, f"{p}.2")
            h = conv_bn_relu(b, h, width, width * 4, 1, 1, f"{p}.3", relu=False)
            if i == 0:
                sc = conv_bn_relu(b, y, cin, width * 4, 1, stride, f"{p}.downsample", relu=False)
            else:
                sc = y
            y = b.op("Relu", [b.op("Add", [h, sc])])
            b.pop(2)
            cin = width * 4
    y = b.op("GlobalAveragePool", [y])
    y = b.op("Flatten", [y], axis=1)
    w = b.weight("fc.weight", (1000, 2048))
    bias = b.weight("fc.bias", (1000,), scale=0.01)
    y = b.op("Gemm", [y, w, bias], alpha=1.0, beta=1.0, transB=1)
    b.output(y, "logits", TensorProto.FLOAT, ["batch", 1000])
    return b.model("ResNet-50 v1.5, torch export style: Conv without bias + BatchNormalization + Relu.")


def conv_relu(b: Builder, x: str, cin: int, cout: int, k: int, prefix: str, stride: int = 1) -> str:
    w = b.weight(f"{prefix}.weight", (cout, cin, k, k), scale=math.sqrt(2.0 / (cin * k * k)))
    bias = b.weight(f"{prefix}.bias", (cout,), scale=0.01)
    y = b.op("Conv", [x, w, bias], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)
    return b.op("Relu", [y])


def inception_v1() -> onnx.ModelProto:
    b = Builder("inception_v1", seed=1, producer=("onnx-caffe2", ""))
    x = b.input("data_0", TensorProto.FLOAT, ["N", 3, 224, 224])
    y = conv_relu(b, x, 3, 64, 7, "conv1/7x7_s2", stride=2)
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])
    y = b.op("LRN", [y], size=5, alpha=1e-4, beta=0.75, bias=1.0)
    y = conv_relu(b, y, 64, 64, 1, "conv2/3x3_reduce")
    y = conv_relu(b, y, 64, 192, 3, "conv2/3x3")
    y = b.op("LRN", [y], size=5, alpha=1e-4, beta=0.75, bias=1.0)
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])
    cin = 192
    modules = [
        ("3a", 64, 96, 128, 16, 32, 32),
        ("3b", 128, 128, 192, 32, 96, 64),
        "pool",
        ("4a", 192, 96, 208, 16, 48, 64),
        ("4b", 160, 112, 224, 24, 64, 64),
        ("4c", 128, 128, 256, 24, 64, 64),
        ("4d", 112, 144, 288, 32, 64, 64),
        ("4e", 256, 160, 320, 32, 128, 128),
        "pool",
        ("5a", 256, 160, 320, 32, 128, 128),
        ("5b", 384, 192, 384, 48, 128, 128),
    ]
    for m in modules:
        if m == "pool":
            y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])
            continue
        name, c1, r3, c3, r5, c5, pp = m
        p = f"inception_{name}"
        b1 = conv_relu(b, y, cin, c1, 1, f"{p}/1x1")
        b2 = conv_relu(b, conv_relu(b, y, cin, r3, 1, f"{p}/3x3_reduce"), r3, c3, 3, f"{p}/3x3")
        b3 = conv_relu(b, conv_relu(b, y, cin, r5, 1, f"{p}/5x5_reduce"), r5, c5, 5, f"{p}/5x5")
        b4 = conv_relu(
            b,
            b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
            cin,
            pp,
            1,
            f"{p}/pool_proj",
        )
        y = b.op("Concat", [b1, b2, b3, b4], axis=1)
        cin = c1 + c3 + c5 + pp
    y = b.op("GlobalAveragePool", [y])
    y = b.op("Dropout", [y])
    y = b.op("Flatten", [y], axis=1)
    y = b.op(
        "Gemm",
        [y, b.weight("loss3/classifier.weight", (1000, 1024)), b.weight("loss3/classifier.bias", (1000,), scale=0.01)],
        transB=1,
    )
    y = b.op("Softmax", [y], axis=1)
    b.output(y, "prob_1", TensorProto.FLOAT, ["N", 1000])
    return b.model("GoogLeNet (Inception v1), model-zoo style: Conv with bias, parallel 1x1 branches, LRN, Dropout.")


def tf_style_nhwc() -> onnx.ModelProto:
    """tf2onnx style: NHWC tensors, every Conv / pool wrapped in a Transpose pair, per-channel ops in NHWC."""
    b = Builder("tf_style_nhwc", seed=7, producer=("tf2onnx", "1.16.1 15c810"))
    x = b.input("input_1", TensorProto.FLOAT, ["unk__0", 64, 64, 3])
    to_nchw, to_nhwc = [0, 3, 1, 2], [0, 2, 3, 1]

    def conv(y: str, cin: int, cout: int, k: int, stride: int, name: str) -> str:
        b.push(name)
        t = b.op("Transpose", [y], perm=to_nchw)
        w = b.weight(f"{name}/kernel", (cout, cin, k, k), scale=math.sqrt(2.0 / (cin * k * k)))
        bias = b.weight(f"{name}/bias", (cout,), scale=0.01)
        t = b.op(
            "Conv",
            [t, w, bias],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
            dilations=[1, 1],
            group=1,
        )
        y = b.op("Transpose", [t], perm=to_nhwc)
        b.pop()
        return y

    def bn_relu(y: str, c: int, name: str) -> str:
        scale = b.weight(f"{name}/scale", (c,), value=1.0 + 0.1 * b.rng.standard_normal(c))
        shift = b.weight(f"{name}/shift", (c,), value=0.1 * b.rng.standard_normal(c))
        y = b.op("Add", [b.op("Mul", [y, scale]), shift])
        return b.op("Relu", [y])

    y = bn_relu(conv(x, 3, 32, 3, 2, "stem_conv"), 32, "stem_bn")
    c = 32
    for i, (cout, stride) in enumerate([(32, 1), (64, 2), (64, 1), (128, 2), (128, 1)]):
        h = bn_relu(conv(y, c, cout, 3, stride, f"block{i}_conv1"), cout, f"block{i}_bn1")
        h = conv(h, cout, cout, 3, 1, f"block{i}_conv2")
        scale = b.weight(f"block{i}_bn2/scale", (cout,), value=1.0 + 0.1 * b.rng.standard_normal(cout))
        h = b.op("Mul", [h, scale])
        sc = y if (stride == 1 and c == cout) else conv(y, c, cout, 1, stride, f"block{i}_proj")
        y = b.op("Relu", [b.op("Add", [h, sc])])
        c = cout
    t = b.op("Transpose", [y], perm=to_nchw)
    t = b.op("MaxPool", [t], kernel_shape=[2, 2], strides=[2, 2])
    y = b.op("Transpose", [t], perm=to_nhwc)
    y = b.op("ReduceMean", [y], axes=[1, 2], keepdims=0)
    y = b.op("MatMul", [y, b.weight("dense/kernel", (c, 10))])
    y = b.op("Add", [y, b.weight("dense/bias", (10,), scale=0.01)])
    y = b.op("Softmax", [y], axis=-1)
    b.output(y, "dense", TensorProto.FLOAT, ["unk__0", 10])
    return b.model(
        "Keras ResNet-style CNN converted by tf2onnx: NHWC activations, Transpose pairs around Conv and MaxPool."
    )


# ---------------------------------------------------------------- transformers


def dim(b: Builder, x: str, axis: int) -> str:
    """Shape(x)[axis] as a 1-D tensor, the way the TorchScript exporter spells `x.size(axis)` in a view."""
    s = b.op("Shape", [x])
    g = b.op("Gather", [s, b.const(axis, np.int64)], axis=0)
    return b.op("Unsqueeze", [g, b.const([0], np.int64)])


def layer_norm(b: Builder, x: str, prefix: str, h: int, weights) -> str:
    b.push(prefix.split(".")[-1])
    mean = b.op("ReduceMean", [x], axes=[-1], keepdims=1)
    d = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Pow", [d, b.const(2.0, np.float32)])], axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.const(1e-12, np.float32)])])
    y = b.op("Div", [d, std])
    y = b.op("Mul", [y, weights(f"{prefix}.weight", (h,), 1.0)])
    y = b.op("Add", [y, weights(f"{prefix}.bias", (h,), 0.0)])
    b.pop()
    return y


def linear(b: Builder, x: str, prefix: str, fin: int, fout: int, weights) -> str:
    b.push(prefix.split(".")[-1])
    y = b.op("MatMul", [x, weights(f"{prefix}.weight", (fin, fout), None)])
    y = b.op("Add", [weights(f"{prefix}.bias", (fout,), 0.02), y])
    b.pop()
    return y


def split_heads(b: Builder, x: str, heads: int, hd: int, perm: list[int]) -> str:
    shape = b.op("Concat", [dim(b, x, 0), dim(b, x, 1), b.const([heads], np.int64), b.const([hd], np.int64)], axis=0)
    return b.op("Transpose", [b.op("Reshape", [x, shape])], perm=perm)


def merge_heads(b: Builder, x: str, hidden: int) -> str:
    x = b.op("Transpose", [x], perm=[0, 2, 1, 3])
    shape = b.op("Concat", [dim(b, x, 0), dim(b, x, 1), b.const([hidden], np.int64)], axis=0)
    return b.op("Reshape", [x, shape])


def weight_maker(b: Builder, dtype):
    """Weights in `dtype`; float16 weights get the Cast to float32 that fp16-exported checkpoints carry."""

    def make(name: str, shape: tuple, fill: float | None) -> str:
        if fill is None:
            value = b.rng.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[0])
        elif fill == 1.0:
            value = 1.0 + 0.05 * b.rng.standard_normal(shape, dtype=np.float32)
        else:
            value = (fill or 0.02) * b.rng.standard_normal(shape, dtype=np.float32)
        w = b.weight(name, shape, dtype=dtype, value=value)
        if dtype == np.float16:
            w = b.op("Cast", [w], to=TensorProto.FLOAT)
        return w

    return make


def bert(
    name: str,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    ff: int = 1024,
    vocab: int = 8192,
    max_pos: int = 512,
    dtype=np.float32,
    seed: int = 2,
) -> onnx.ModelProto:
    b = Builder(name, seed=seed)
    W = weight_maker(b, dtype)
    hd = hidden // heads
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = b.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    b.push("embeddings")
    seq = dim(b, ids, 1)
    pos_ids = b.op(
        "Slice",
        [
            b.weight("embeddings.position_ids", (1, max_pos), dtype=np.int64, value=np.arange(max_pos)[None]),
            b.const([0], np.int64),
            seq,
            b.const([1], np.int64),
            b.const([1], np.int64),
        ],
    )
    tok_type = b.op("ConstantOfShape", [b.op("Shape", [ids])], value=numpy_helper.from_array(np.zeros(1, np.int64)))
    e = b.op("Gather", [W("embeddings.word_embeddings.weight", (vocab, hidden), 0.02), ids], axis=0)
    e = b.op(
        "Add", [e, b.op("Gather", [W("embeddings.token_type_embeddings.weight", (2, hidden), 0.02), tok_type], axis=0)]
    )
    e = b.op(
        "Add",
        [e, b.op("Gather", [W("embeddings.position_embeddings.weight", (max_pos, hidden), 0.02), pos_ids], axis=0)],
    )
    x = layer_norm(b, e, "embeddings.LayerNorm", hidden, W)
    b.pop()
    m = b.op("Unsqueeze", [b.op("Unsqueeze", [mask, b.const([1], np.int64)]), b.const([2], np.int64)])
    m = b.op("Cast", [m], to=TensorProto.FLOAT)
    m = b.op("Mul", [b.op("Sub", [b.const(1.0, np.float32), m]), b.const(-3.4028234663852886e38, np.float32)])
    for i in range(layers):
        p = f"encoder.layer.{i}"
        b.push("encoder", f"layer.{i}", "attention", "self")
        q = split_heads(b, linear(b, x, f"{p}.attention.self.query", hidden, hidden, W), heads, hd, [0, 2, 1, 3])
        k = split_heads(b, linear(b, x, f"{p}.attention.self.key", hidden, hidden, W), heads, hd, [0, 2, 3, 1])
        v = split_heads(b, linear(b, x, f"{p}.attention.self.value", hidden, hidden, W), heads, hd, [0, 2, 1, 3])
        s = b.op("Div", [b.op("MatMul", [q, k]), b.const(math.sqrt(hd), np.float32)])
        s = b.op("Softmax", [b.op("Add", [s, m])], axis=-1)
        ctx = merge_heads(b, b.op("MatMul", [s, v]), hidden)
        b.pop(2)
        b.push("output")
        a = linear(b, ctx, f"{p}.attention.output.dense", hidden, hidden, W)
        x = layer_norm(b, b.op("Add", [a, x]), f"{p}.attention.output.LayerNorm", hidden, W)
        b.pop(2)
        b.push("intermediate")
        h = linear(b, x, f"{p}.intermediate.dense", hidden, ff, W)
        g = b.op("Erf", [b.op("Div", [h, b.const(1.4142135381698608, np.float32)])])
        h = b.op("Mul", [b.op("Mul", [h, b.op("Add", [g, b.const(1.0, np.float32)])]), b.const(0.5, np.float32)])
        b.pop()
        b.push("output")
        o = linear(b, h, f"{p}.output.dense", ff, hidden, W)
        x = layer_norm(b, b.op("Add", [o, x]), f"{p}.output.LayerNorm", hidden, W)
        b.pop(3)
    b.output(x, "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden])
    b.push("pooler")
    first = b.op("Gather", [x, b.const(0, np.int64)], axis=1)
    pooled = b.op(
        "Tanh",
        [
            b.op(
                "Gemm",
                [first, W("pooler.dense.weight", (hidden, hidden), None), W("pooler.dense.bias", (hidden,), 0.02)],
                transB=1,
            )
        ],
    )
    b.pop()
    b.output(pooled, "pooler_output", TensorProto.FLOAT, ["batch", hidden])
    kind = "float16 weights, each Cast to float32 at run time" if dtype == np.float16 else "float32 weights"
    return b.model(f"BERT-style encoder ({layers} layers, hidden {hidden}), TorchScript export style, {kind}.")


def gpt2_small(
    layers: int = 4, hidden: int = 256, heads: int = 4, vocab: int = 8192, n_ctx: int = 1024
) -> onnx.ModelProto:
    b = Builder("gpt2_small", seed=3)
    W = weight_maker(b, np.float32)
    hd = hidden // heads
    ids = b.input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    seq_scalar = b.op("Gather", [b.op("Shape", [ids]), b.const(1, np.int64)], axis=0)
    pos = b.op(
        "Unsqueeze", [b.op("Range", [b.const(0, np.int64), seq_scalar, b.const(1, np.int64)]), b.const([0], np.int64)]
    )
    wte = W("transformer.wte.weight", (vocab, hidden), 0.02)
    x = b.op(
        "Add",
        [
            b.op("Gather", [wte, ids], axis=0),
            b.op("Gather", [W("transformer.wpe.weight", (n_ctx, hidden), 0.01), pos], axis=0),
        ],
    )
    causal = b.weight(
        "transformer.h.bias",
        (1, 1, n_ctx, n_ctx),
        dtype=np.bool_,
        value=np.tril(np.ones((n_ctx, n_ctx), bool))[None, None],
    )
    for i in range(layers):
        p = f"transformer.h.{i}"
        b.push("transformer", f"h.{i}")
        h = layer_norm(b, x, f"{p}.ln_1", hidden, W)
        b.push("attn")
        qkv = linear(b, h, f"{p}.attn.c_attn", hidden, 3 * hidden, W)
        q, k, v = b.op("Split", [qkv, b.const([hidden] * 3, np.int64)], n_out=3, axis=2)
        q = split_heads(b, q, heads, hd, [0, 2, 1, 3])
        k = split_heads(b, k, heads, hd, [0, 2, 3, 1])
        v = split_heads(b, v, heads, hd, [0, 2, 1, 3])
        s = b.op("Div", [b.op("MatMul", [q, k]), b.const(math.sqrt(hd), np.float32)])
        qlen, klen = dim(b, q, 2), dim(b, k, 3)
        start = b.op("Sub", [klen, qlen])
        band = b.op("Slice", [causal, start, klen, b.const([2], np.int64), b.const([1], np.int64)])
        band = b.op("Slice", [band, b.const([0], np.int64), klen, b.const([3], np.int64), b.const([1], np.int64)])
        s = b.op("Where", [band, s, b.const(-3.4028234663852886e38, np.float32)])
        s = b.op("Softmax", [s], axis=-1)
        ctx = merge_heads(b, b.op("MatMul", [s, v]), hidden)
        a = linear(b, ctx, f"{p}.attn.c_proj", hidden, hidden, W)
        b.pop()
        x = b.op("Add", [a, x])
        h = layer_norm(b, x, f"{p}.ln_2", hidden, W)
        b.push("mlp")
        h = linear(b, h, f"{p}.mlp.c_fc", hidden, 4 * hidden, W)
        cube = b.op("Mul", [b.op("Pow", [h, b.const(3.0, np.float32)]), b.const(0.044715, np.float32)])
        t = b.op("Tanh", [b.op("Mul", [b.op("Add", [h, cube]), b.const(math.sqrt(2 / math.pi), np.float32)])])
        h = b.op("Mul", [b.op("Mul", [b.const(0.5, np.float32), h]), b.op("Add", [b.const(1.0, np.float32), t])])
        h = linear(b, h, f"{p}.mlp.c_proj", 4 * hidden, hidden, W)
        b.pop()
        x = b.op("Add", [x, h])
        b.pop(2)
    x = layer_norm(b, x, "transformer.ln_f", hidden, W)
    logits = b.op("MatMul", [x, b.op("Transpose", [wte], perm=[1, 0])])
    b.output(logits, "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])
    return b.model(
        f"GPT-2-style decoder ({layers} layers, hidden {hidden}), TorchScript export style: fused c_attn + Split, "
        "tanh GELU, causal mask sliced from a buffer, tied lm_head through a Transpose of wte."
    )


def wide_ensemble(branches: int = 8, fin: int = 64, width: int = 128, classes: int = 10) -> onnx.ModelProto:
    """Eight same-shape MLP branches on eight inputs, averaged: the fold pass's stacking case."""
    b = Builder("wide_ensemble", seed=8)
    outs = []
    for i in range(branches):
        x = b.input(f"x{i}", TensorProto.FLOAT, ["batch", fin])
        b.push(f"branch{i}")
        for j, (a, c) in enumerate([(fin, width), (width, width), (width, classes)]):
            x = b.op("MatMul", [x, b.weight(f"branch{i}.fc{j}.weight", (a, c))])
            x = b.op("Add", [x, b.weight(f"branch{i}.fc{j}.bias", (c,), scale=0.05)])
            if j < 2:
                x = b.op("Relu", [x])
        b.pop()
        outs.append(x)
    y = b.op("Div", [b.op("Sum", outs), b.const(float(branches), np.float32)])
    y = b.op("Softmax", [y], axis=-1)
    b.output(y, "probs", TensorProto.FLOAT, ["batch", classes])
    return b.model("An ensemble of eight MLPs, one per input, averaged.")


MODELS = {
    "resnet50": resnet50,
    "inception_v1": inception_v1,
    "tf_style_nhwc": tf_style_nhwc,
    "bert_small": lambda: bert("bert_small"),
    "bert_fp16_weights": lambda: bert("bert_fp16_weights", dtype=np.float16, seed=16),
    "gpt2_small": gpt2_small,
    "wide_ensemble": wide_ensemble,
}


def build(out: Path, names: Iterable[str] | None = None, *, force: bool = False) -> list[Path]:
    """Write the models ``names`` (default: all) into ``out`` as NAME.onnx; those already there are kept
    unless ``force``. Each file appears whole or not at all, so concurrent builds (test workers) may share
    ``out``. Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names if names is not None else MODELS:
        path = out / f"{name}.onnx"
        if path.exists() and not force:
            continue
        model = MODELS[name]()
        onnx.checker.check_model(model, full_check=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        onnx.save(model, partial)
        partial.replace(path)
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--only", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild models that already exist")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    unknown = set(names) - set(MODELS)
    if unknown:
        print(f"unknown model(s): {', '.join(sorted(unknown))}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for path in build(args.out, names, force=args.force):
        print(f"{path}  {path.stat().st_size / 1e6:.1f} MB")
    print(f"corpus in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
