"""Build the sample models that `make run` optimizes (small, deterministic, in exporter style).

    python samples/build_samples.py [--out DIR]

tiny_encoder.onnx: one attention-free encoder block with dynamic `batch` and `seq`, the
Shape -> Gather -> Concat -> Reshape plumbing that exporters write, an inference-mode
Dropout, Identity nodes and a duplicated constant: everything the cleanup passes remove.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 32


def tiny_encoder() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), f"{name}_value")
        )

    nodes = [
        helper.make_node("Identity", ["x"], ["x_id"], name="/input/Identity"),
        helper.make_node("Shape", ["x_id"], ["shape"], name="/Shape"),
        const("zero", [0]),
        const("one", [1]),
        const("zero_again", [0]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="/Gather_batch", axis=0),
        helper.make_node("Gather", ["shape", "one"], ["seq"], name="/Gather_seq", axis=0),
        const("hidden", [HIDDEN]),
        helper.make_node("Concat", ["batch", "seq", "hidden"], ["target"], name="/Concat", axis=0),
        helper.make_node("MatMul", ["x_id", "fc1.weight"], ["h1"], name="/fc1/MatMul"),
        helper.make_node("Add", ["h1", "fc1.bias"], ["h2"], name="/fc1/Add"),
        helper.make_node("Relu", ["h2"], ["h3"], name="/Relu"),
        helper.make_node("Dropout", ["h3"], ["h4"], name="/Dropout"),
        helper.make_node("MatMul", ["h4", "fc2.weight"], ["h5"], name="/fc2/MatMul"),
        helper.make_node("Reshape", ["h5", "target"], ["h6"], name="/Reshape"),
        helper.make_node("Add", ["h6", "x"], ["h7"], name="/residual/Add"),
        helper.make_node("Gather", ["shape", "zero_again"], ["batch_again"], name="/Gather_batch_again", axis=0),
        helper.make_node("Identity", ["h7"], ["y"], name="/output/Identity"),
        helper.make_node("Identity", ["batch_again"], ["unused"], name="/unused/Identity"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [
            weight("fc1.weight", HIDDEN, 2 * HIDDEN),
            weight("fc1.bias", 2 * HIDDEN),
            weight("fc2.weight", 2 * HIDDEN, HIDDEN),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="graphopt-samples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny_encoder(), args.out / "tiny_encoder.onnx")
    print(f"wrote {args.out / 'tiny_encoder.onnx'}")


if __name__ == "__main__":
    main()
