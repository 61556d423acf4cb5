"""What `graphopt inspect` shows: a model's signature, ops, parameters and structure."""

from __future__ import annotations

from typing import Any

from graphopt.ir import Model, SparseTensor, Tensor
from graphopt.ir.stats import model_stats

__all__ = ["inspect_model"]


def inspect_model(model: Model, path: str, file_bytes: int | None = None) -> dict[str, Any]:
    """What `graphopt inspect` shows of ``model``, read from ``path``; ``file_bytes``, the
    size of its files (the model's and its external data), when known."""
    stats = model_stats(model)
    graph = model.graph
    parameters = 0
    for value in graph.initializers.values():
        if isinstance(value.const, Tensor):
            parameters += value.const.size
        elif isinstance(value.const, SparseTensor):
            parameters += value.const.values.size
    # Exporters such as paddle2onnx keep the weights in Constant nodes, not initializers
    # (the integer Constants of shape plumbing are not parameters).
    constants = [
        tensor
        for node in graph
        if node.op_type == "Constant"
        and isinstance(tensor := node.attr("value"), Tensor)
        and tensor.dtype.name.startswith(("FLOAT", "BFLOAT", "DOUBLE"))
    ]
    parameters += sum(tensor.size for tensor in constants)
    owners = [body.parent.op_type for body in graph.subgraphs() if body.parent is not None]
    initializer_names = set(graph.initializers)
    return {
        "path": path,
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opsets": dict(model.opset_imports),
        "inputs": [
            {"name": v.name, "type": str(v.type) if v.type is not None else "?"}
            for v in graph.inputs
            if v.name not in initializer_names
        ],
        "outputs": [{"name": v.name, "type": str(v.type) if v.type is not None else "?"} for v in graph.outputs],
        "nodes": stats.nodes,
        "ops": stats.ops,
        "initializers": stats.initializers,
        "parameters": parameters,
        "constant_nodes": len(constants),
        "parameter_bytes": stats.initializer_bytes,
        "file_bytes": file_bytes,
        "subgraphs": len(owners),
        "subgraph_owners": owners,
        "functions": [f"{f.domain}.{f.name}" for f in model.functions],
        "metadata_props": dict(model.metadata_props),
    }
