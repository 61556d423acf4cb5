"""What the bench measures on a written model: node counts, bytes on disk, onnxruntime latency.

Latency is measured for many models at once, interleaved run by run (each round runs every
session once, starting at a different one each round), so a burst of machine noise lands on
all of them rather than on whichever model happened to be running. Each model's time is
also divided by the reference model's time in the same round and the median of those
paired ratios kept: on a shared machine the load drifts over a run, and a ratio taken
within one round cancels the drift that a ratio of two medians keeps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from graphopt.numerics.inputs import bind_dims, dim_keys, make_inputs, read_spec

# onnxruntime's own op domains: nodes only onnxruntime can run.
CONTRIB_DOMAINS = frozenset({"com.microsoft", "com.microsoft.nchwc", "com.microsoft.internal.nhwc"})
SEQ_DIM_LENGTH = 64
# Named dims that mean a sequence length get SEQ_DIM_LENGTH; every other dynamic dim is 1 (batch).
_SEQ_WORDS = ("seq", "len", "token", "time", "step")
LEVELS = ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL")


@dataclass(frozen=True)
class NodeCount:
    total: int
    contrib: int


def subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every If / Loop / Scan body in it, at any depth."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from subgraphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from subgraphs(sub)


def node_count(path: Path) -> NodeCount:
    """Nodes in the model, subgraph bodies included; ``contrib`` counts onnxruntime-only ones."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = [node for graph in subgraphs(model.graph) for node in graph.node]
    return NodeCount(len(nodes), sum(node.domain in CONTRIB_DOMAINS for node in nodes))


def output_bytes(path: Path) -> int:
    """The model file plus every external-data file it names."""
    model = onnx.load(str(path), load_external_data=False)
    locations = {
        entry.value
        for graph in subgraphs(model.graph)
        for tensor in graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in locations)


def latency_dims(path: Path, given: dict[str, int]) -> dict[str, int]:
    """A value for every dynamic dim: ``given``, else SEQ_DIM_LENGTH for sequence-like names, else 1 (unnamed: 1)."""
    keys = dim_keys(read_spec(path))
    guessed = {
        d: SEQ_DIM_LENGTH if any(w in d.lower() for w in _SEQ_WORDS) and not d.endswith("]") else 1 for d in keys
    }
    return guessed | {k: v for k, v in given.items() if k in keys}


def latency_feeds(path: Path, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs at ``dims`` (see latency_dims), drawn the way graphopt's check draws them."""
    spec = read_spec(path)
    return make_inputs(spec, bind_dims(spec, 0, dims), np.random.default_rng(seed))


def session_graph(path: Path, level: str = "ORT_ENABLE_ALL") -> list[tuple[str, ...]]:
    """The graph onnxruntime runs for ``path`` at ``level``, as a list comparable across files: per node in its
    order, the op, its domain, its attributes and its inputs (a value produced inside by its producer's position, an
    initializer by its shape, type and the sum of its absolute values). Two files with equal lists run the same
    kernels on the same weights, so a timing difference between them is the machine's. An attribute set to its
    schema's default is left out: onnxruntime writes the defaults of the newer versions of an op out (Cast's
    ``saturate``, QuantizeLinear's ``output_dtype`` at opset 23), so one graph saved at two opsets would differ."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "session.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        options.optimized_model_filepath = str(saved)
        options.log_severity_level = 3
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        saved_model = onnx.load(str(saved))
    graph = saved_model.graph
    opsets = {entry.domain or "ai.onnx": entry.version for entry in saved_model.opset_import}
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    produced: dict[str, str] = {}
    nodes = []
    for position, found in enumerate(graph.node):
        inputs = []
        for name in found.input:
            if name in weights:
                array = weights[name]
                inputs.append(f"{array.shape}:{array.dtype}:{np.abs(array.astype(np.float64)).sum():.9g}")
            else:
                inputs.append(produced.get(name, name))
        produced.update({name: f"{position}.{index}" for index, name in enumerate(found.output)})
        defaults = _default_attributes(found.op_type, found.domain, opsets)
        attributes = sorted(
            f"{a.name}={onnx.helper.get_attribute_value(a)!r}" for a in found.attribute if defaults.get(a.name) != a
        )
        nodes.append((found.op_type, found.domain, *inputs, "|", *attributes))
    return nodes


def _default_attributes(op: str, domain: str, opsets: dict[str, int]) -> dict[str, onnx.AttributeProto]:
    """The attributes with a default in ``op``'s schema at the model's opset, named as in a node (none where onnx
    has no schema for it: onnxruntime's own fused kernels)."""
    try:
        schema = onnx.defs.get_schema(op, opsets.get(domain or "ai.onnx", 1), domain)
    except onnx.defs.SchemaError:
        return {}
    found = {}
    for name, attribute in schema.attributes.items():
        if attribute.default_value.type != onnx.AttributeProto.UNDEFINED:
            default = onnx.AttributeProto()
            default.CopyFrom(attribute.default_value)
            default.name = name
            found[name] = default
    return found


SESSIONS_PER_MODEL = 3


def interleaved_latency(
    models: dict[str, Path],
    feeds: dict[str, np.ndarray],
    level: str,
    *,
    runs: int,
    warmup: int,
    sessions: int = SESSIONS_PER_MODEL,
) -> dict[str, dict[str, float] | str]:
    """Per model at ``level``: median and min seconds of one run, and the median ratio to the
    first model's run of the same round (``paired``, with its 95% interval ``paired_low`` ..
    ``paired_high``); or the error that stopped the model.

    Each model gets ``sessions`` sessions, created in turn with the other models' and used in
    turn by the rounds: where a session's weights and buffers land in memory moves its time by
    a few percent (two sessions of one file differ by up to 3% on efficientnet_b0, 1 thread,
    with the graphs onnxruntime runs identical), so one session per model would count that
    placement as a difference between the files, and the interval would not show it."""
    import onnxruntime as ort

    opened: dict[str, list[ort.InferenceSession]] = {}
    results: dict[str, dict[str, float] | str] = {}
    for _ in range(sessions):
        for key, path in models.items():
            if key in results:
                continue
            options = ort.SessionOptions()
            options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            try:
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                wanted = {i.name for i in session.get_inputs()}
                session.run(None, {k: v for k, v in feeds.items() if k in wanted})
            except Exception as err:
                results[key] = f"error: {str(err).strip().splitlines()[0][:200]}"
                opened.pop(key, None)
                continue
            opened.setdefault(key, []).append(session)
    order = list(opened)
    inputs = {key: {i.name: feeds[i.name] for i in s[0].get_inputs() if i.name in feeds} for key, s in opened.items()}
    samples: dict[str, list[float]] = {key: [] for key in order}
    for round_index in range(warmup + runs):
        shift = round_index % max(len(order), 1)
        for key in order[shift:] + order[:shift]:
            session = opened[key][round_index % len(opened[key])]
            start = time.perf_counter()
            session.run(None, inputs[key])
            if round_index >= warmup:
                samples[key].append(time.perf_counter() - start)
    reference = samples.get(next(iter(models), ""), [])
    for key, values in samples.items():
        stats = {"median_s": statistics.median(values), "min_s": min(values)}
        if reference:
            ratios = [v / r for v, r in zip(values, reference, strict=True)]
            stats["paired"] = statistics.median(ratios)
            stats["paired_low"], stats["paired_high"] = median_interval(ratios)
        results[key] = stats
    return results


def median_interval(samples: list[float], resamples: int = 1000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``samples`` (seeded: reruns agree)."""
    drawn = np.random.default_rng(0).choice(np.asarray(samples), (resamples, len(samples)))
    low, high = np.percentile(np.median(drawn, axis=1), [2.5, 97.5])
    return float(low), float(high)
