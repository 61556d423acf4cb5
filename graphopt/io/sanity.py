"""Sanity on load, beyond what the formats check: opsets and tensor sizes.

Refused (bad input, one line): an opset import no onnx version defines, a node in an
ONNX domain the model does not import, a tensor no machine could hold.

- Every ONNX domain the model imports must be at a version this onnx package knows (>= 1).
- Every node in an ONNX domain needs that domain imported. A custom domain (com.microsoft)
  the main graph uses without an import is imported at version 1 with a warning, as
  onnxruntime reads it (an error with ``strict``).
- An op ONNX defines that does not exist, or is removed, at the imported version
  (LayerNormalization at opset 12, Scatter at opset 17) is accepted with a warning and
  marked opaque: onnxruntime runs such models (older exporters wrote them), and a pass
  must not reason about an op at a version it has no schema for, so the passes keep the
  node as it is. With ``strict`` (``graphopt validate``) it is an error instead. An op name
  ONNX does not define at all is a custom op, even in the default domain (legacy exporters
  write such ops): the passes keep it untouched too. Function bodies are checked against
  their own imports.
- No node reads its own output.
- A QuantizeLinear or DequantizeLinear whose constant scale is infinite, NaN or zero is accepted
  with a warning: it loses every value it quantizes or dequantizes (quantize_static
  calibrated on an attention mask's -inf writes such a scale), so the model's outputs there are
  not what its float program computes, and no optimization brings them back.
- A declared tensor type (graph input or output, annotated value, initializer) must take
  fewer than 2**63 bytes, the int64 limit of ONNX dims and of every runtime's byte counts.
  Anything smaller is valid; whether the numerics check can afford to feed it is the
  check's business.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import onnx.defs
from onnx.onnx_cpp2py_export.defs import schema_version_map

from graphopt.errors import InputError
from graphopt.ir import Graph, Model, Node, TensorType
from graphopt.ir.constness import constant_array

__all__ = ["check_model"]

_MAX_BYTES = 2**63

_ALIASES = {"ai.onnx": ""}


def _domain_text(domain: str) -> str:
    return repr(domain) if domain else "the default domain"


def check_model(model: Model, *, strict: bool = False) -> list[str]:
    """Raise InputError naming the first opset import, node or tensor type that cannot be.

    Returns the warnings: one per op kept opaque (or, with ``strict``, raises for the first).
    """
    warnings = _check_opsets(model, strict)
    _check_sizes(model)
    _check_self_reads(model)
    return warnings + _check_scales(model)


_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _check_scales(model: Model) -> list[str]:
    """One warning naming the Q/DQ nodes whose constant scale is infinite, NaN or zero (none: no warning)."""
    broken: Counter[str] = Counter()
    first: str | None = None
    for graph in model.all_graphs():
        for node in graph:
            if node.op_type not in _QDQ or len(node.inputs) < 2:
                continue
            scale = constant_array(node.inputs[1])
            if scale is not None and scale.size and not bool(np.all(np.isfinite(scale) & (scale != 0))):
                broken[node.op_type] += 1
                read = node.inputs[0]
                first = first or (_label(node) if node.name or read is None else f"the {node.op_type} of {read.name!r}")
    if not broken:
        return []
    counted = " and ".join(f"{count} {op}" for op, count in sorted(broken.items(), reverse=True))
    return [
        f"{counted} have a scale that is infinite, NaN or zero (the first: {first}): they lose every "
        "value they quantize or dequantize (to NaN, infinity, a bound or zero), so the model's outputs there are not "
        "what its float program computes (a calibration that read an attention mask's -inf writes such a scale); "
        "quantizing again without those tensors (quantize_static's nodes_to_exclude) mends the model, no "
        "optimization does"
    ]


def _check_self_reads(model: Model) -> None:
    """A node that reads its own output is a cycle of length one (onnx's checker refuses it;
    the IR's ordering, which looks only at edges between nodes, would not notice)."""
    for graph in model.all_graphs():
        for node in graph:
            produced = {id(v) for v in node.outputs}
            looped = next((v for v in node.inputs if v is not None and id(v) in produced), None)
            if looped is not None:
                label = f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"
                raise InputError(f"{label} reads its own output {looped.name!r} (a cycle)")


def _check_sizes(model: Model) -> None:
    for graph in model.all_graphs():
        for value in [*graph.values(), *graph.outputs]:
            if isinstance(value.type, TensorType) and value.type.shape is not None:
                static = [d for d in value.type.shape if isinstance(d, int)]
                nbytes = (math.prod(static) * value.type.dtype.itemsize_bits + 7) // 8
                if nbytes >= _MAX_BYTES:
                    raise InputError(f"value {value.name!r} declares {value.type}, over 2**63 bytes")


def _check_opsets(model: Model, strict: bool) -> list[str]:
    known = schema_version_map()
    imports = _normalized(model.opset_imports)
    for domain, version in imports.items():
        if domain in known:
            low, high = known[domain]
            if not low <= version <= high:
                known_range = f"onnx {onnx.__version__} knows {low}..{high}"
                raise InputError(f"opset {version} of {_domain_text(domain)} does not exist ({known_range})")
    local_functions = {f.domain for f in model.functions}
    adopted = _adopt_custom_domains(model, imports, known, local_functions, strict)
    graphs = [(model.graph, imports)]
    graphs += [(f.body, _normalized(f.opset_imports)) for f in model.functions]
    unknown: Counter[tuple[str, str]] = Counter()
    for root, scope in graphs:
        for graph in [root, *root.subgraphs()]:
            for node, problem in _check_nodes(graph, scope, known, local_functions):
                if strict:
                    raise InputError(f"{_label(node)} {problem}")
                unknown[node.op_type, problem] += 1
    kept = "kept as an opaque op, nothing is folded or inferred through it"
    opaque = [f"{op} ({count} node{'s' * (count > 1)}) {problem}: {kept}" for (op, problem), count in unknown.items()]
    return adopted + opaque


def _adopt_custom_domains(
    model: Model, imports: dict[str, int], known: dict[str, tuple[int, int]], functions: set[str], strict: bool
) -> list[str]:
    """Import at version 1 the custom domains (com.microsoft, not an ONNX domain) the main graph's
    nodes use without an import, as onnxruntime reads such a model (exporters and its own tests
    write them); the written model then imports them. With ``strict``, an error."""
    graphs = [model.graph, *model.graph.subgraphs()]
    used = {_ALIASES.get(node.domain, node.domain) for graph in graphs for node in graph}
    missing = sorted(used - set(imports) - set(known) - functions)
    if missing and strict:
        raise InputError(f"nodes are in {_domain_text(missing[0])}, which the model does not import")
    for domain in missing:
        model.opset_imports[domain] = imports[domain] = 1
    adopted = "without an import of it: imported at version 1, as onnxruntime reads them"
    return [f"nodes in {_domain_text(domain)} {adopted}" for domain in missing]


def _label(node: Node) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"


def _normalized(imports: dict[str, int]) -> dict[str, int]:
    return {_ALIASES.get(domain, domain): version for domain, version in imports.items()}


def _check_nodes(
    graph: Graph, imports: dict[str, int], known: dict[str, tuple[int, int]], functions: set[str]
) -> Iterator[tuple[Node, str]]:
    """Raise for nodes that cannot be; mark ops without a schema at the opset opaque and yield why."""
    for node in graph:
        domain = _ALIASES.get(node.domain, node.domain)
        if domain not in imports:
            if domain in functions:
                continue
            raise InputError(f"{_label(node)} is in {_domain_text(domain)}, which the model does not import")
        if domain not in known or not onnx.defs.has(node.op_type, domain):
            continue
        version = imports[domain]
        try:
            schema = onnx.defs.get_schema(node.op_type, version, domain)
        except onnx.defs.SchemaError:
            first = _first_version(node.op_type, domain, known[domain][1])
            node.opaque = True
            yield node, f"does not exist at opset {version} of {_domain_text(domain)} (it appears at opset {first})"
            continue
        if schema.deprecated:
            node.opaque = True
            yield node, f"is deprecated (removed) at opset {version} of {_domain_text(domain)}"


def _first_version(op_type: str, domain: str, newest: int) -> int:
    since = onnx.defs.get_schema(op_type, newest, domain).since_version
    while since > 1:
        try:
            since = onnx.defs.get_schema(op_type, since - 1, domain).since_version
        except onnx.defs.SchemaError:
            break
    return since
