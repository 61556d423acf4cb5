"""Measure the fold pass's cost table: onnxruntime time of one kernel, per op kind and size.

    python benchmarks/fold_costs.py                 # prints the table for graphopt/passes/fold/costs.py
    python benchmarks/fold_costs.py --runs 300 --json-out costs.json

For each kind and size, two models run interleaved (1 thread, ORT_ENABLE_ALL and
ORT_DISABLE_ALL): a chain of CHAIN (op, Relu) steps and a chain of CHAIN Relus alone, on
the same tensor. The op's time is the paired difference divided by CHAIN. The Relus keep
onnxruntime from merging consecutive ops (two Transposes, two Gathers) into one. Kinds:

- matmul: [rows, depth] x constant [depth, depth], or a pair depth -> width -> depth
  (two kernels; work: multiply-adds of one)
- conv: 1x1 Conv, [1, C, H, W] -> C channels (work: multiply-adds)
- grouped-conv: the fold's rows layout, [1, F*depth, rows, 1], F groups (work: multiply-adds;
  rows 1 or a multiple of 16, see costs._grouped_conv_work)
- elementwise: Add of a constant (work: elements)
- gather, transpose, split-concat (a Split in 4 and the Concat back), work: elements
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure

CHAIN = 8
Step = Callable[[str, str, list[onnx.TensorProto], int], list[onnx.NodeProto]]


def _model(shape: list[int], step: Step | None, rng: np.random.Generator) -> onnx.ModelProto:
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current = "x"
    for index in range(CHAIN):
        if step is not None:
            nodes += step(current, f"op{index}", inits, index)
            current = f"op{index}"
        nodes.append(helper.make_node("Relu", [current], [f"relu{index}"]))
        current = f"relu{index}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _const(inits: list[onnx.TensorProto], name: str, array: np.ndarray) -> str:
    inits.append(numpy_helper.from_array(array, name))
    return name


def kinds(rng: np.random.Generator) -> dict[str, list[tuple[list[int], int, Step]]]:
    """Per kind: (input shape, work, step) at a range of sizes."""

    def matmul(depth: int, width: int) -> Step:
        def step(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
            w = (rng.standard_normal((depth, width)) / np.sqrt(depth)).astype(np.float32)
            if width == depth:
                return [helper.make_node("MatMul", [x, _const(inits, f"w{i}", w)], [y])]
            back = (rng.standard_normal((width, depth)) / np.sqrt(width)).astype(np.float32)
            return [
                helper.make_node("MatMul", [x, _const(inits, f"w{i}", w)], [f"{y}_wide"]),
                helper.make_node("MatMul", [f"{y}_wide", _const(inits, f"back{i}", back)], [y]),
            ]

        return step

    def conv(channels: int, groups: int) -> Step:
        def step(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
            per = channels // groups
            w = (rng.standard_normal((channels, per, 1, 1)) / np.sqrt(per)).astype(np.float32)
            return [helper.make_node("Conv", [x, _const(inits, f"w{i}", w)], [y], group=groups, kernel_shape=[1, 1])]

        return step

    def add(shape: list[int]) -> Step:
        def step(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
            b = rng.standard_normal(shape[-1:]).astype(np.float32)
            return [helper.make_node("Add", [x, _const(inits, f"b{i}", b)], [y])]

        return step

    def gather(width: int) -> Step:
        def step(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
            order = rng.permutation(width).astype(np.int64)
            return [helper.make_node("Gather", [x, _const(inits, f"g{i}", order)], [y], axis=1)]

        return step

    def transpose(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
        return [helper.make_node("Transpose", [x], [y], perm=[1, 0])]

    def split_concat(x: str, y: str, inits: list[onnx.TensorProto], i: int) -> list[onnx.NodeProto]:
        parts = [f"{y}_part{p}" for p in range(4)]
        return [
            helper.make_node("Split", [x], parts, axis=1),
            helper.make_node("Concat", parts, [y], axis=1),
        ]

    table: dict[str, list[tuple[list[int], int, Step]]] = {
        "matmul": [],
        "conv": [],
        "grouped-conv": [],
        "elementwise": [],
        "gather": [],
        "transpose": [],
        "split-concat": [],
    }
    for rows, depth in [(1, 64), (1, 256), (8, 128), (64, 64), (64, 256), (64, 768), (256, 512)]:
        table["matmul"].append(([rows, depth], rows * depth * depth, matmul(depth, depth)))
    # Folded widths: a pair depth -> width -> depth, timed as two kernels of rows*depth*width.
    for rows, depth, width in [(1, 64, 512), (1, 256, 768), (64, 256, 512), (64, 256, 768), (64, 256, 1024)]:
        table["matmul"].append(([rows, depth], rows * depth * width, matmul(depth, width)))
    for channels, side in [(16, 14), (64, 14), (64, 28), (192, 28), (256, 28), (512, 14), (832, 7)]:
        table["conv"].append(([1, channels, side, side], channels * channels * side * side, conv(channels, 1)))
    for folds, depth, rows in [(8, 64, 1), (8, 128, 1), (8, 128, 32), (4, 256, 64), (8, 64, 256)]:
        work = folds * depth * depth * rows
        table["grouped-conv"].append(([1, folds * depth, rows, 1], work, conv(folds * depth, folds)))
    for elements in [256, 2048, 16384, 131072, 1048576]:
        width = 256 if elements >= 256 else elements
        shape = [elements // width, width]
        table["elementwise"].append((shape, elements, add(shape)))
        table["gather"].append((shape, elements, gather(width)))
        table["split-concat"].append((shape, elements, split_concat))
        side = int(np.sqrt(elements))
        table["transpose"].append(([side, side], side * side, transpose))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--kinds", help="comma list of kinds to measure (default: all)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    wanted = set(args.kinds.split(",")) if args.kinds else None
    results: dict[str, dict[str, list[list[float]]]] = {level: {} for level in measure.LEVELS}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, entries in kinds(rng).items():
            if wanted is not None and kind not in wanted:
                continue
            for number, (shape, work, step) in enumerate(entries):
                base = Path(tmp) / f"{kind}{number}_base.onnx"
                chain = Path(tmp) / f"{kind}{number}.onnx"
                onnx.save(_model(shape, None, rng), base)
                onnx.save(_model(shape, step, rng), chain)
                feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
                for level in measure.LEVELS:
                    timed = measure.interleaved_latency(
                        {"base": base, "chain": chain}, feeds, level, runs=args.runs, warmup=args.warmup
                    )
                    base_s, chain_s = timed["base"], timed["chain"]
                    assert isinstance(base_s, dict) and isinstance(chain_s, dict), (base_s, chain_s)
                    kernels = CHAIN * (2 if kind == "matmul" and work != shape[0] * shape[1] ** 2 else 1)
                    per_op_us = max(chain_s["median_s"] - base_s["median_s"], 0.0) / kernels * 1e6
                    results[level].setdefault(kind, []).append([work, round(per_op_us, 3)])
                    print(f"{level:16} {kind:13} work={work:>10} {per_op_us:9.2f} us", flush=True)
    text = json.dumps(results, indent=1)
    if args.json_out:
        args.json_out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
