"""What onnxruntime makes of a model: a count of the fused kernels its optimizer forms.

onnxruntime fuses op patterns itself when it loads a model at ORT_ENABLE_ALL (Gelu,
SkipLayerNormalization, FusedConv, FusedMatMul, Convs laid out in NCHWc blocks, ...). A
rewrite can take away what one of those fusions reads, and the output then runs slower than
the original although it has fewer nodes (a GELU's closing 0.5 folded into the next Conv:
onnxruntime's Gelu fusion no longer matches). A census loads a model on the CPU provider at
ORT_ENABLE_ALL, has onnxruntime save the graph it would run
(``SessionOptions.optimized_model_filepath``), and counts that graph's fused kernels by
:class:`Kind`; :func:`losses` compares the census of the original with the output's.

A kind names the kernels that stand for one another: an Attention the original's runtime
graph had may be a MultiHeadAttention graphopt wrote, a BiasGelu a Gelu whose bias went into
a Gemm. A kind may also be absorbed by another (the Q K^T FusedMatMul by the attention
kernel graphopt wrote): the kernels the output gained of the absorbing kind make up for as
many lost. A fused op graphopt itself wrote is in the output's runtime graph, so it counts as
kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from graphopt.files import scratch_folder

if TYPE_CHECKING:
    import onnx

__all__ = ["KINDS", "Census", "Kind", "Loss", "census_of_file", "losses"]

NCHWC_DOMAIN = "com.microsoft.nchwc"
_REORDERS = frozenset({"ReorderInput", "ReorderOutput"})
# How far from a fused kernel its site is looked for (values onnxruntime made lie between).
_SITE_STEPS = 4
# The file onnxruntime writes the runtime graph's weights to, beside the graph.
_RUNTIME_WEIGHTS = "weights.bin"


@dataclass(frozen=True)
class Kind:
    """Fused kernels that stand for one another: ``ops`` (any domain), or every op of
    ``domain`` but ``except_ops``. ``worse`` says which way a change costs time: fewer
    fused kernels, more of them (the NCHWc reorders, copies between layouts), or neither (a
    fused kernel measured slower than what it replaces: counted, never guarded)."""

    name: str
    ops: frozenset[str] = frozenset()
    domain: str | None = None
    except_ops: frozenset[str] = frozenset()
    worse: Literal["fewer", "more", "neither"] = "fewer"
    absorbed_by: tuple[str, ...] = ()
    absorbs: int = 1  # how many of these one kernel of an absorbed_by kind may stand for
    removed_with: tuple[str, ...] = ()  # kinds whose kernels host these: fewer of them excuse as many losses

    def holds(self, domain: str, op_type: str) -> bool:
        if self.domain is not None:
            return domain == self.domain and op_type not in self.except_ops
        return op_type in self.ops


def _ops(*names: str) -> frozenset[str]:
    return frozenset(names)


KINDS: tuple[Kind, ...] = (
    Kind(
        "Attention",
        _ops(
            "Attention",
            "MultiHeadAttention",
            "GroupQueryAttention",
            "PackedAttention",
            "PackedMultiHeadAttention",
            "SparseAttention",
            "DecoderMaskedMultiHeadAttention",
        ),
    ),
    Kind("EmbedLayerNormalization", _ops("EmbedLayerNormalization")),
    # Its CPU kernel measured 4-8x slower than the Add and LayerNormalization it replaces, and
    # the norm family's layernorm-residual-sum keeps onnxruntime from forming it (residual.py).
    Kind("SkipLayerNormalization", _ops("SkipLayerNormalization"), worse="neither"),
    Kind("SkipSimplifiedLayerNormalization", _ops("SkipSimplifiedLayerNormalization")),
    Kind("LayerNormalization", _ops("LayerNormalization"), absorbed_by=("SkipLayerNormalization",)),
    Kind(
        "SimplifiedLayerNormalization",
        _ops("SimplifiedLayerNormalization", "RMSNormalization"),
        absorbed_by=("SkipSimplifiedLayerNormalization",),
    ),
    Kind("Gelu", _ops("Gelu", "FastGelu", "BiasGelu")),
    Kind("QuickGelu", _ops("QuickGelu", "Swish")),  # x * sigmoid(alpha x): opset 24's Swish is graphopt's
    # Every Conv kernel, laid out in blocks or not: where the output runs fewer (merged branches, a Conv
    # CSE found twice), the NCHWc and FusedConv kernels they were go with them and are not lost.
    Kind("Conv kernels", _ops("Conv", "FusedConv", "NhwcFusedConv"), worse="neither"),
    Kind("FusedConv", _ops("FusedConv", "NhwcFusedConv"), removed_with=("Conv kernels",)),
    Kind("FusedGemm", _ops("FusedGemm")),
    Kind("FusedMatMul", _ops("FusedMatMul"), absorbed_by=("Attention",)),
    Kind("MatMulNBits", _ops("MatMulNBits")),
    Kind("DynamicQuantizeMatMul", _ops("DynamicQuantizeMatMul", "MatMulIntegerToFloat")),
    # graphopt's rotary and attention fusions through Q/DQ take up to three integer kernels onnxruntime
    # would run each: the rotary's two Muls and its Add (QLinearMul, QLinearAdd), the attention's scale
    # Mul and its two MatMuls (QLinearMul, QLinearMatMul). The TorchScript QDQ Llama with a KV cache at
    # opset 23: 25 -> 13 with 8 RotaryEmbedding and 4 Attention; the TorchScript QDQ Phi-3 at --target
    # ort 29 -> 13 with 8 RotaryEmbedding and 4 MultiHeadAttention, where counting one each had the
    # guard undo cse for 4 of them (973 nodes, 1.05x the variant's time, against 528 and 0.72x). The
    # census cannot tell which gained kernels were fused through Q/DQ: every one excuses up to three.
    Kind("RotaryEmbedding", _ops("RotaryEmbedding")),
    Kind(
        "QLinear",
        _ops("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QAttention"),
        absorbed_by=("RotaryEmbedding", "Attention"),
        absorbs=3,
    ),
    Kind("NCHWc", domain=NCHWC_DOMAIN, except_ops=_REORDERS, removed_with=("Conv kernels",)),
    Kind("NCHWc reorders", _REORDERS, worse="more"),
)


@dataclass
class Census:
    """The fused kernels of one model's runtime graph: per kind, the first output name of each
    (where it is; the names of the model's values onnxruntime fused)."""

    sites: dict[str, list[str]] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return len(self.sites.get(kind, []))

    def counts(self) -> dict[str, int]:
        return {kind: len(found) for kind, found in self.sites.items() if found}


@dataclass(frozen=True)
class Loss:
    """A kind of fused kernel the output's runtime graph has fewer of (more, for a kind that is
    worse so) than the original's: ``before`` -> ``after``, and ``at``, a value where it went."""

    kind: str
    before: int
    after: int
    at: str

    def describe(self) -> str:
        if self.kind == UNLOADED:
            return self.at.rstrip(".")  # onnxruntime's sentence, in a line that goes on after it
        change = "adds" if self.after > self.before else "no longer forms"  # a kind worse the more of it
        return f"onnxruntime {change} {self.kind} at {self.at} ({self.before} -> {self.after})"

    @classmethod
    def unloaded(cls, reason: str) -> Loss:
        """The loss of the session itself: onnxruntime refuses the output at ORT_ENABLE_ALL,
        where it loads the original (``reason``: why, a sentence)."""
        return cls(UNLOADED, 1, 0, reason)


# The kind of a Loss.unloaded: not a kernel, the whole session.
UNLOADED = "session"


def census_of_file(path: str | os.PathLike[str], names: Collection[str] | None = None) -> Census:
    """Load the model at ``path`` in onnxruntime (CPU provider, ORT_ENABLE_ALL) and count the
    fused kernels of the graph it would run. Each is placed at the nearest value of the model
    (``names``: its values' names, by default read from the file), as onnxruntime names the
    values it makes itself (``reorder_token_2``). onnxruntime's errors propagate."""
    import onnx
    import onnxruntime as ort

    if names is None:
        graph = onnx.load(os.fspath(path), load_external_data=False).graph
        names = {v.name for v in graph.input} | {o for n in _all_nodes(graph) for o in n.output}
    with scratch_folder() as folder:
        runtime_graph = folder / "runtime.onnx"
        # The census reads the graph, never the weights: where the system allows, they go to the
        # null device (writing gpt2's 22 MB cost its census 0.09 s of 0.26; the graph is the same).
        with contextlib.suppress(OSError):
            (folder / _RUNTIME_WEIGHTS).symlink_to(os.devnull)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(runtime_graph)
        options.log_severity_level = 3  # the NCHWc transformer's "hardware specific" warning
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.disable_prepacking", "1")  # the graph is the same, sooner
        # Weights go to a file of their own: a model past protobuf's 2 GB saves as well.
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", _RUNTIME_WEIGHTS)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
        return _count(onnx.load(str(runtime_graph), load_external_data=False).graph, set(names))


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` and of their bodies."""
    for node in graph.node:
        yield node
        for body in _bodies(node):
            yield from _all_nodes(body)


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    import onnx

    found: list[onnx.GraphProto] = []
    for attr in node.attribute:
        found += [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
    return found


def _live(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` (and of their bodies) that the graph's outputs depend on: a kernel
    no output reads is no fusion to keep (onnxruntime runs a model's dead nodes as they are,
    and removing them is no loss)."""
    producer = {name: node for node in graph.node for name in node.output}
    pending, seen, live = [o.name for o in graph.output], set(), set()
    while pending:
        name = pending.pop()
        node = producer.get(name)
        if name in seen or node is None:
            seen.add(name)
            continue
        seen.add(name)
        if id(node) not in live:
            live.add(id(node))
            pending += node.input
            pending += [i for body in _bodies(node) for n in _all_nodes(body) for i in n.input]
    for node in graph.node:
        if id(node) in live:
            yield node
            for body in _bodies(node):
                yield from _all_nodes(body)


def _count(graph: onnx.GraphProto, names: set[str]) -> Census:
    nodes = list(_live(graph))
    readers: dict[str, list[onnx.NodeProto]] = {}
    producer: dict[str, onnx.NodeProto] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
        producer.update((name, node) for name in node.output)

    def nearest(start: list[str], step: Callable[[str], Iterable[str]]) -> str | None:
        frontier, seen = start, set(start)
        for _ in range(_SITE_STEPS):
            found = next((name for name in frontier if name in names), None)
            if found is not None:
                return found
            frontier = [n for n in dict.fromkeys(n for name in frontier for n in step(name)) if n and n not in seen]
            seen.update(frontier)
        return None

    def site(node: onnx.NodeProto) -> str:
        """The nearest value the model names: what the kernel computes, downstream first, else
        what it reads."""
        after = nearest(list(node.output), lambda name: (o for r in readers.get(name, []) for o in r.output))
        before = after or nearest(list(node.input), lambda name: producer[name].input if name in producer else ())
        return before or node.name

    sites: dict[str, list[str]] = {}
    for node in nodes:
        fused_conv = node.domain == NCHWC_DOMAIN and any(a.name == "activation" for a in node.attribute)
        for kind in KINDS:
            # A FusedConv the NCHWc transformer laid out in blocks is an NCHWc Conv with an activation.
            if kind.holds(node.domain, node.op_type) or (fused_conv and kind.name == "FusedConv"):
                sites.setdefault(kind.name, []).append(site(node))
    return Census(sites)


def losses(original: Census, output: Census, *, removed: bool = True) -> list[Loss]:
    """The kinds the output lost against the original, in :data:`KINDS` order. A kind absorbed
    by another is excused ``absorbs`` losses per kernel the output gained of the absorbing kind, and (with
    ``removed``) one removed with another as many as the output has fewer of that one."""
    found = []
    for kind in KINDS:
        if kind.worse == "neither":
            continue
        before, after = original.count(kind.name), output.count(kind.name)
        if kind.worse == "more":
            before, after = -before, -after
        gained = kind.absorbs * sum(max(0, output.count(k) - original.count(k)) for k in kind.absorbed_by)
        if removed:
            gained += sum(max(0, original.count(k) - output.count(k)) for k in kind.removed_with)
        if after + gained >= before:
            continue
        if kind.worse == "more":
            at = _first_new(output.sites.get(kind.name, []), original.sites.get(kind.name, []))
            found.append(Loss(kind.name, -before, -after, at))
        else:
            at = _first_new(original.sites.get(kind.name, []), output.sites.get(kind.name, []))
            found.append(Loss(kind.name, before, after, at))
    return found


def _first_new(sites: list[str], others: list[str]) -> str:
    """The first of ``sites`` not among ``others`` (the first of ``sites`` when all are)."""
    seen = set(others)
    return next((site for site in sites if site not in seen), sites[0] if sites else "?")
