"""Whether onnxruntime's GroupQueryAttention beats the MultiHeadAttention ``--target ort`` writes
for grouped-query attention (issues 23, 36), on one layer stack of the llama exports' shape, with a KV cache
(``--past``: the past length; 0, no cache).

    python benchmarks/ort_gqa_probe.py [--kv-heads N] [--seq S ...] [--past P] [--batch B] [--runs N]

What each would be fed, from the exports' rotated K (batch, kv heads, seq, head size) and V
(batch, seq, kv heads * head size) and their float mask bias (batch, 1, seq, seq):

- MultiHeadAttention: K and V joined to the past (Concat, the present outputs) with their heads repeated
  (Unsqueeze / Expand / Reshape, as the exporters write it), V transposed to its heads first, the mask as
  attention_bias;
- GroupQueryAttention (as ort-group-query-attention writes it): K transposed back to (batch, seq, kv heads *
  head size), V as it is, the pasts in, the presents out, seqlens_k = total - 1, total_sequence_length =
  past + seq, the same mask as attention_bias (its CPU kernel is causal only and reads padding from seqlens_k
  as right padding, so an export's arbitrary padding mask has to stay a bias).

Both outputs are compared (except the padded row's queries that see no key), then timed
interleaved at ORT_ENABLE_ALL, 1 thread (measure.py); the ratio is GroupQueryAttention's time
over MultiHeadAttention's in the same round.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from measure import interleaved_latency
from onnx import TensorProto, helper, numpy_helper

HEADS, HEAD_SIZE, LAYERS = 8, 32, 4


def _const(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def layer_stack(kind: str, batch: int, seq: int, past: int, kv_heads: int) -> onnx.ModelProto:
    """LAYERS attentions of one query stack, fed as ``kind`` ("mha" or "gqa") would be."""
    rep, total = HEADS // kv_heads, past + seq
    inits = [
        _const("axis2", [2]),
        _const("repeat", [batch, kv_heads, rep, total, HEAD_SIZE]),
        _const("heads", [0, HEADS, -1, HEAD_SIZE]),
        _const("v_heads", [0, 0, kv_heads, HEAD_SIZE]),
        _const("width", [0, 0, -1]),
        numpy_helper.from_array(np.full(batch, total - 1, np.int32), "seqlens_k"),
        numpy_helper.from_array(np.array(total, np.int32), "total"),
    ]
    nodes, x, presents = [], "q", []
    for layer in range(LAYERS):
        out = f"out{layer}"
        if kind == "mha":
            presents += [f"present_k{layer}", f"present_v{layer}"]
            nodes += [
                helper.make_node("Concat", [f"past_k{layer}", "k"], [f"present_k{layer}"], axis=2),
                helper.make_node("Unsqueeze", [f"present_k{layer}", "axis2"], [f"ku{layer}"]),
                helper.make_node("Expand", [f"ku{layer}", "repeat"], [f"ke{layer}"]),
                helper.make_node("Reshape", [f"ke{layer}", "heads"], [f"kr{layer}"]),
                helper.make_node("Reshape", ["v", "v_heads"], [f"v4{layer}"]),
                helper.make_node("Transpose", [f"v4{layer}"], [f"vt{layer}"], perm=[0, 2, 1, 3]),
                helper.make_node("Concat", [f"past_v{layer}", f"vt{layer}"], [f"present_v{layer}"], axis=2),
                helper.make_node("Unsqueeze", [f"present_v{layer}", "axis2"], [f"vu{layer}"]),
                helper.make_node("Expand", [f"vu{layer}", "repeat"], [f"ve{layer}"]),
                helper.make_node("Reshape", [f"ve{layer}", "heads"], [f"vr{layer}"]),
                helper.make_node(
                    "MultiHeadAttention",
                    [x, f"kr{layer}", f"vr{layer}", "", "", "bias"],
                    [out],
                    domain="com.microsoft",
                    num_heads=HEADS,
                ),
            ]
        else:
            presents += [f"present_k{layer}", f"present_v{layer}"]
            pasts = [f"past_k{layer}", f"past_v{layer}"]
            nodes += [
                helper.make_node("Transpose", ["k"], [f"kt{layer}"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", [f"kt{layer}", "width"], [f"k3{layer}"]),
                helper.make_node(
                    "GroupQueryAttention",
                    [x, f"k3{layer}", "v", *pasts, "seqlens_k", "total", "", "", "", "bias"],
                    [out, f"present_k{layer}", f"present_v{layer}"],
                    domain="com.microsoft",
                    num_heads=HEADS,
                    kv_num_heads=kv_heads,
                ),
            ]
        x = out
    cache = [batch, kv_heads, past, HEAD_SIZE]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, seq, HEADS * HEAD_SIZE]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [batch, kv_heads, seq, HEAD_SIZE]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [batch, seq, kv_heads * HEAD_SIZE]),
        helper.make_tensor_value_info("bias", TensorProto.FLOAT, [batch, 1, seq, total]),
        *(helper.make_tensor_value_info(f"past_{n}{i}", TensorProto.FLOAT, cache) for i in range(LAYERS) for n in "kv"),
    ]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in [x, *presents]]
    graph = helper.make_graph(nodes, kind, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def feeds(batch: int, seq: int, past: int, kv_heads: int) -> dict[str, np.ndarray]:
    """Random Q / K / V and pasts; the causal band over the past as a float bias, the last row left-padded by 2
    (finfo.min, as dynamo writes)."""
    rng = np.random.default_rng(seq)
    total = past + seq
    band = np.arange(total)[None, :] <= past + np.arange(seq)[:, None]
    allowed = np.broadcast_to(band, (batch, 1, seq, total)).copy()
    allowed[-1, :, :, :2] = False
    cache = (batch, kv_heads, past, HEAD_SIZE)
    return {
        "q": rng.standard_normal((batch, seq, HEADS * HEAD_SIZE)).astype(np.float32),
        "k": rng.standard_normal((batch, kv_heads, seq, HEAD_SIZE)).astype(np.float32),
        "v": rng.standard_normal((batch, seq, kv_heads * HEAD_SIZE)).astype(np.float32),
        "bias": np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32),
        **{f"past_{n}{i}": rng.standard_normal(cache).astype(np.float32) for i in range(LAYERS) for n in "kv"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-heads", type=int, default=2, help="K / V heads (default 2, of 8 query heads)")
    parser.add_argument("--seq", type=int, nargs="*", default=[17, 128], help="sequence lengths (default 17 128)")
    parser.add_argument("--past", type=int, default=0, help="past length of the KV cache (default 0: no cache)")
    parser.add_argument("--batch", type=int, default=2, help="batch (default 2)")
    parser.add_argument("--runs", type=int, default=200, help="timed rounds (default 200)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq:
            inputs = feeds(args.batch, seq, args.past, args.kv_heads)
            paths = {}
            for kind in ("mha", "gqa"):
                paths[kind] = Path(tmp) / f"{kind}.onnx"
                onnx.save(layer_stack(kind, args.batch, seq, args.past, args.kv_heads), paths[kind])
            outs = [
                ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, inputs)
                for p in paths.values()
            ]
            presents = max(float(np.abs(a - b).max()) for a, b in zip(outs[0][1:], outs[1][1:], strict=True))
            # The padded row's first 2 queries see no key: each kernel fills them its own way (the exports zero them).
            differ = np.abs(outs[0][0] - outs[1][0])
            differ[-1, : max(0, 2 - args.past)] = 0
            stats = interleaved_latency(paths, inputs, "ORT_ENABLE_ALL", runs=args.runs, warmup=20)
            mha, gqa = stats["mha"], stats["gqa"]
            assert isinstance(mha, dict) and isinstance(gqa, dict), stats
            print(
                f"batch {args.batch}, seq {seq}, past {args.past}, {args.kv_heads} kv heads: "
                f"max |gqa - mha| {float(differ.max()):.2e} (presents {presents:.1e}); "
                f"mha {mha['median_s'] * 1e6:.0f} us, gqa {gqa['median_s'] * 1e6:.0f} us, "
                f"gqa / mha {gqa['paired']:.3f} [{gqa['paired_low']:.3f}, {gqa['paired_high']:.3f}]"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
