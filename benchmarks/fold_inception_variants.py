"""Ways to realize inception_v1's 1x1 fold, built by hand on the unfolded model and timed.

    python benchmarks/fold_inception_variants.py --corpus DIR --runs 200

Why: with every fold taken the fold pass makes inception_v1 slower at ORT_ENABLE_ALL. Its
Split (onnxruntime turns a Slice of the same tensor into a Split too) has no NCHWc kernel,
so the folded Conv's output leaves the blocked layout and each slice read by a Conv enters
it again. Each variant folds, in every Inception module (or the ones named), the 1x1 Convs
that read the module's input: ``all`` (the 1x1 branch and the 3x3 / 5x5 reduces) or
``reduce`` (the reduces only, so the module's Concat keeps reading an NCHWc Conv), with the
Relus folded into one Relu before the Split or left on each slice. ``unfolded_copy`` is the
unfolded model again (the noise floor). Printed: onnxruntime's reorder nodes at
ORT_ENABLE_ALL, and per level the median of folded / unfolded over interleaved rounds with
its 95% interval.
"""

from __future__ import annotations

import collections
import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure
from fold_bench import _without_fold, _write, timing_parser

from graphopt.passes.pipeline import DEFAULT_PIPELINE

VARIANTS: dict[str, dict[str, Any] | None] = {
    "unfolded_copy": None,
    "all_split_relu": {},
    "all_slice_relu": {"slicer": "slice"},
    "all_split_norelu": {"fold_relu": False},
    "reduce_split_relu": {"pick": "reduce"},
    "reduce_split_norelu": {"pick": "reduce", "fold_relu": False},
    "all_3x": {"modules": [0, 1]},
    "all_4x": {"modules": [2, 3, 4, 5, 6]},
    "all_5x": {"modules": [7, 8]},
    "reduce_4x": {"pick": "reduce", "modules": [2, 3, 4, 5, 6]},
    "reduce_5x": {"pick": "reduce", "modules": [7, 8]},
    "all_4bc": {"modules": [3, 4]},
    "reduce_4bc": {"pick": "reduce", "modules": [3, 4]},
}

Member = tuple[onnx.NodeProto, onnx.NodeProto]  # a 1x1 Conv and the Relu after it


def sibling_groups(model: onnx.ModelProto) -> list[tuple[str, list[Member], list[str]]]:
    """Per module: the shared input, its (Conv, Relu) 1x1 members, and each member's role
    ("concat" when its Relu feeds the module's Concat, else "reduce")."""
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            readers[name].append(node)
    by_input: dict[str, list[Member]] = collections.defaultdict(list)
    for node in model.graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "Conv" else None
        if weight is None or tuple(weight.dims[2:]) != (1, 1):
            continue
        after = readers[node.output[0]]
        if len(after) == 1 and after[0].op_type == "Relu":
            by_input[node.input[0]].append((node, after[0]))
    return [
        (x, members, ["concat" if any(r.op_type == "Concat" for r in readers[relu.output[0]]) else "reduce"
                      for _, relu in members])
        for x, members in by_input.items()
        if len(members) > 1
    ]  # fmt: skip


def variant(
    model: onnx.ModelProto, pick: str = "all", fold_relu: bool = True, slicer: str = "split", modules: Any = None
) -> onnx.ModelProto:
    model = copy.deepcopy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    # Nodes are keyed by their first output: protobuf hands out a new wrapper per access.
    inserted: dict[str, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    removed: set[str] = set()
    for k, (x, members, roles) in enumerate(sibling_groups(model)):
        chosen = [m for m, role in zip(members, roles, strict=True) if pick == "all" or role == "reduce"]
        if (modules is not None and k not in modules) or len(chosen) < 2:
            continue
        weights = [numpy_helper.to_array(inits[conv.input[1]]) for conv, _ in chosen]
        biases = [numpy_helper.to_array(inits[conv.input[2]]) for conv, _ in chosen]
        graph.initializer.extend(
            [numpy_helper.from_array(np.concatenate(weights), f"fw{k}"),
             numpy_helper.from_array(np.concatenate(biases), f"fb{k}")]
        )  # fmt: skip
        attributes = {a.name: helper.get_attribute_value(a) for a in chosen[0][0].attribute}
        nodes = [helper.make_node("Conv", [x, f"fw{k}", f"fb{k}"], [f"fconv{k}"], **attributes)]
        tensor = f"fconv{k}"
        if fold_relu:
            nodes.append(helper.make_node("Relu", [tensor], [f"frelu{k}"]))
            tensor = f"frelu{k}"
        widths = [w.shape[0] for w in weights]
        parts = [f"fpart{k}_{i}" for i in range(len(chosen))]
        if slicer == "split":
            graph.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), f"fsplit{k}"))
            nodes.append(helper.make_node("Split", [tensor, f"fsplit{k}"], parts, axis=1))
        else:
            bounds = np.cumsum([0, *widths])
            for i, part in enumerate(parts):
                ends = [
                    numpy_helper.from_array(np.array([b], np.int64), f"f{k}_{i}_{j}")
                    for j, b in enumerate(bounds[i : i + 2])
                ]
                axis = numpy_helper.from_array(np.array([1], np.int64), f"f{k}_{i}_axis")
                graph.initializer.extend([*ends, axis])
                nodes.append(helper.make_node("Slice", [tensor, *(e.name for e in ends), axis.name], [part]))
        for (conv, relu), part in zip(chosen, parts, strict=True):
            if fold_relu:
                renamed[relu.output[0]] = part
            else:
                nodes.append(helper.make_node("Relu", [part], [relu.output[0]]))
            removed.update({conv.output[0], relu.output[0]})
        inserted[chosen[0][0].output[0]] = nodes
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        kept.extend(inserted.get(node.output[0], []))
        if node.output[0] not in removed:
            kept.append(node)
    for node in kept:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    del graph.node[:]
    graph.node.extend(kept)
    return model


def measure_outputs(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _reorders(path: Path, tmp: Path, feeds: dict[str, np.ndarray], expected: np.ndarray) -> str:
    """onnxruntime's reorder nodes at ORT_ENABLE_ALL (after checking the outputs)."""
    import onnxruntime as ort

    np.testing.assert_allclose(measure_outputs(path, feeds), expected, rtol=1e-4, atol=1e-6)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp / "ort.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp / "ort.onnx")).graph.node)
    return f"ReorderOutput {ops['ReorderOutput']}, ReorderInput {ops['ReorderInput']}, Split {ops['Split']}"


def main() -> None:
    parser = timing_parser(__doc__, runs=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    source = args.corpus / "inception_v1.onnx"
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        paths = {"unfolded": tmp / "unfolded.onnx"}
        _write(source, paths["unfolded"], _without_fold(DEFAULT_PIPELINE))
        unfolded = onnx.load(str(paths["unfolded"]))
        for name in args.variants.split(","):
            spec = VARIANTS[name]
            paths[name] = tmp / f"{name}.onnx"
            onnx.save(unfolded if spec is None else variant(unfolded, **spec), paths[name])
        feeds = measure.latency_feeds(source, measure.latency_dims(source, {}))
        expected = measure_outputs(paths["unfolded"], feeds)
        for name, path in paths.items():
            print(f"{name:20} ORT_ENABLE_ALL: {_reorders(path, tmp, feeds, expected)}", flush=True)
        for level in measure.LEVELS:
            timed = measure.interleaved_latency(paths, feeds, level, runs=args.runs, warmup=args.warmup)
            for name, got in timed.items():
                if isinstance(got, dict):
                    interval = f"[{got['paired_low']:.4f}, {got['paired_high']:.4f}]"
                    print(f"{level:16} {name:20} {got['median_s'] * 1e3:7.2f} ms  {got['paired']:.4f} {interval}")
                else:
                    print(f"{level:16} {name:20} {got}")


if __name__ == "__main__":
    main()
