"""Where two models start to disagree: every intermediate tensor compared, in graph order.

Given the last model that still passed the check and the first that failed (blame's two
neighbours), both are copied with every value of the main graph that they share by name
marked as a graph output (the scratch copies live in a work folder; external data is
linked in beside them), run by onnxruntime on the same inputs (the check's first binding,
or the user's .npz), and compared value by value in the failing model's node order with
the check's own criterion. The first node whose output fails is named with its figures,
the way Polygraphy's ``--mark all`` bisects a model by hand.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphopt.numerics.check import json_ready, session_options
from graphopt.numerics.compare import Criterion, compare_output
from graphopt.numerics.feeds import Feed
from graphopt.numerics.feeds import run as run_session
from graphopt.numerics.inputs import bind_dims, load_npz, make_inputs, read_spec
from graphopt.numerics.options import CheckOptions
from graphopt.numerics.paths import output_paths

__all__ = ["first_divergence"]


def first_divergence(
    good: str | os.PathLike[str],
    bad: str | os.PathLike[str],
    workdir: str | os.PathLike[str],
    check: CheckOptions | None = None,
) -> dict[str, Any]:
    """The first node of ``bad`` whose output differs from the same-named value in ``good``, fed
    ``check``'s inputs (or its dims' first binding) and compared by its criterion.

        Returns ``{"node", "op_type", "output", "compared", ...figures}``, or ``{"node": None,
        "reason"}`` when no shared value differs (the change is in values only one model has)
        or the models cannot be run.
    """
    good, bad, workdir = Path(good), Path(bad), Path(workdir)
    proto_good = onnx.load(str(good), load_external_data=False)
    proto_bad = onnx.load(str(bad), load_external_data=False)
    shared = _values(proto_good.graph) & _values(proto_bad.graph)
    order = [(node, name) for node in proto_bad.graph.node for name in node.output if name in shared]
    names = list(dict.fromkeys(name for _, name in order))
    check = check or CheckOptions()
    spec = read_spec(good)
    if check.inputs is not None:
        feed, _ = load_npz(check.inputs, spec.inputs)
    else:
        binding = bind_dims(spec, 0, dict(check.dims))
        feed = make_inputs(spec, binding, np.random.default_rng([0, 0]))
    try:
        options = session_options(1, check.custom_op_libraries)
        values_good = _run_marked(proto_good, good, names, workdir / "good", feed, options)
        values_bad = _run_marked(proto_bad, bad, names, workdir / "bad", feed, options)
    except Exception as exc:  # onnxruntime refused a scratch copy: say so, never fail the blame
        text = str(exc).strip().splitlines()
        return {"node": None, "reason": f"onnxruntime cannot run the marked copies: {text[0] if text else exc}"}
    criterion = Criterion.make(check.atol, check.rtol)
    precisions = output_paths(_marked(proto_good, names).graph)
    for count, (node, name) in enumerate(order, 1):
        comparison = compare_output(name, values_good[name], values_bad[name], criterion, precisions[name].precision)
        if comparison.passed is False:
            figures = {k: v for k, v in vars(comparison).items() if k not in ("name", "passed")}
            found = {"node": node.name, "op_type": node.op_type, "output": name, "compared": count, **figures}
            return dict(json_ready(found))
    return {"node": None, "compared": len(order), "reason": "every value the two models share agrees"}


def _values(graph: onnx.GraphProto) -> set[str]:
    return {name for node in graph.node for name in node.output if name}


def _marked(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    marked = onnx.ModelProto()
    marked.CopyFrom(proto)
    existing = {output.name for output in marked.graph.output}
    marked.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names if name not in existing)
    return marked


def _run_marked(
    proto: onnx.ModelProto,
    source: Path,
    names: list[str],
    folder: Path,
    feed: Mapping[str, Feed],
    options: ort.SessionOptions,
) -> dict[str, np.ndarray]:
    """Every value of ``names`` computed by a copy of ``proto`` that has them as outputs."""
    folder.mkdir(parents=True, exist_ok=True)
    marked = _marked(proto, names)
    for location in _external_locations(marked):
        link = folder / location
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to((source.parent / location).resolve())
    path = folder / "marked.onnx"
    onnx.save(marked, str(path))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    wanted = [output.name for output in session.get_outputs()]
    return {name: np.asarray(value) for name, value in zip(wanted, run_session(session, feed, ort.RunOptions()))}


def _external_locations(proto: onnx.ModelProto) -> set[str]:
    found: set[str] = set()
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            found.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return found
