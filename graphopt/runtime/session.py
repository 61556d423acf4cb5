"""``CachedSession``: a drop-in for ``onnxruntime.InferenceSession(...).run`` that runs a
model's ``runtime_fold`` once per distinct content of the constant inputs.

The const-cache pass writes runtime folds as calls of ``graphopt.runtime`` functions in the
main graph (see :mod:`graphopt.passes.constcache.fold_once`). This session splits the model
at those calls: a ``runtime_fold`` session computes the calls' outputs from their inputs
(graph inputs and initializers), and an ``entry`` session holds those outputs as its own
initializers. Entry sessions are kept in an LRU under a byte budget (the bytes of their
folds), keyed by a hash of the constant feeds; the session is safe to share between
threads, and ``folds`` counts the folds run.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from graphopt.ir.model import RUNTIME_DOMAIN

__all__ = ["CachedSession"]


class CachedSession:
    """``CachedSession(path).run(output_names, feeds)``, as with an InferenceSession."""

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes | onnx.ModelProto,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str] | None = None,
        *,
        cache_bytes: int = 1 << 30,
    ) -> None:
        proto = _load(model)
        self._options = sess_options
        self._providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self.cache_bytes = cache_bytes
        self.folds = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[ort.InferenceSession, int]] = OrderedDict()
        self._cached_bytes = 0
        calls = [n for n in proto.graph.node if n.domain == RUNTIME_DOMAIN]
        self.input_names = [i.name for i in proto.graph.input]
        self.output_names = [o.name for o in proto.graph.output]
        self._fold: ort.InferenceSession | None = None
        self._fold_inputs: list[str] = []
        self._fold_outputs: list[str] = [o for n in calls for o in n.output]
        if not calls:
            self._plain: ort.InferenceSession | None = self._session(proto)
            return
        self._plain = None
        fold_model, self._fold_inputs = _fold_model(proto, calls)
        self._fold = self._session(fold_model)
        self._entry_proto = _entry_model(proto, calls)
        self._entry_inputs = [i.name for i in self._entry_proto.graph.input]

    def _session(self, proto: onnx.ModelProto) -> ort.InferenceSession:
        return ort.InferenceSession(proto.SerializeToString(), self._options, providers=self._providers)

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: ort.RunOptions | None = None,
    ) -> list[Any]:
        if self._plain is not None:
            return self._plain.run(output_names, dict(input_feed), run_options)
        fold_feeds = {k: np.asarray(input_feed[k]) for k in self._fold_inputs if k in input_feed}
        entry = self._entry_for(fold_feeds)
        feeds = {k: input_feed[k] for k in self._entry_inputs if k in input_feed}
        return entry.run(output_names, feeds, run_options)

    def _entry_for(self, feeds: dict[str, np.ndarray]) -> ort.InferenceSession:
        """The entry session for this content of the constant feeds, its folds stored as
        initializers: onnxruntime then prepacks and folds them as it does a model's own
        weights (fed as inputs, they ran 1.2-1.3x slower at ORT_ENABLE_ALL)."""
        key = _digest(feeds)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            assert self._fold is not None
            folded = [np.asarray(a) for a in self._fold.run(self._fold_outputs, feeds)]
            self.folds += 1
            entry = onnx.ModelProto()
            entry.CopyFrom(self._entry_proto)
            entry.graph.initializer.extend(
                numpy_helper.from_array(array, name) for name, array in zip(self._fold_outputs, folded, strict=True)
            )
            session = self._session(entry)
            nbytes = sum(a.nbytes for a in folded)
            if nbytes <= self.cache_bytes:
                self._cache[key] = (session, nbytes)
                self._cached_bytes += nbytes
                while self._cached_bytes > self.cache_bytes:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped
            return session


def _load(model: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model))


def _digest(feeds: Mapping[str, np.ndarray]) -> bytes:
    digest = hashlib.blake2b(digest_size=20)
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.view(np.uint8).data if array.dtype != np.object_ else repr(array.tolist()).encode())
    return digest.digest()


def _fold_model(proto: onnx.ModelProto, calls: Sequence[onnx.NodeProto]) -> tuple[onnx.ModelProto, list[str]]:
    """The calls alone: inputs are the graph inputs they read, plus the initializers they read."""
    read = {name for n in calls for name in n.input if name}
    inputs = [i for i in proto.graph.input if i.name in read]
    initializers = [t for t in proto.graph.initializer if t.name in read]
    outputs = [helper.make_empty_tensor_value_info(o) for n in calls for o in n.output]
    graph = helper.make_graph(list(calls), "runtime_fold", inputs, outputs, initializers)
    called = {(n.domain, n.op_type) for n in calls}
    functions = [f for f in proto.functions if (f.domain, f.name) in called]
    model = helper.make_model(
        graph, opset_imports=list(proto.opset_import), functions=functions, ir_version=proto.ir_version
    )
    return model, [i.name for i in inputs]


def _entry_model(proto: onnx.ModelProto, calls: Sequence[onnx.NodeProto]) -> onnx.ModelProto:
    """The main graph without the calls (their outputs become initializers at each fold)."""
    entry = onnx.ModelProto()
    entry.CopyFrom(proto)
    graph = entry.graph
    call_outputs = {o for n in calls for o in n.output}
    kept = [n for n in graph.node if n.domain != RUNTIME_DOMAIN]
    del graph.node[:]
    graph.node.extend(kept)
    read = _read_names(graph) | {o.name for o in graph.output}
    initializers = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    inputs = [i for i in graph.input if i.name in read and i.name not in call_outputs]
    del graph.input[:]
    graph.input.extend(inputs)
    functions = [f for f in entry.functions if f.domain != RUNTIME_DOMAIN]
    del entry.functions[:]
    entry.functions.extend(functions)
    return entry


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of ``graph`` reads, bodies included."""
    found: set[str] = set()
    for node in graph.node:
        found.update(name for name in node.input if name)
        for attr in node.attribute:
            for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                found |= _read_names(body) | {o.name for o in body.output}
    return found
