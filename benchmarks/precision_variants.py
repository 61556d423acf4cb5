"""Reduced-precision and quantized copies of the real PyTorch exports, and what graphopt does with them.

    python benchmarks/precision_variants.py build   [--exports DIR] [--out VARIANTS] [--only NAME ...] [--kinds K ...]
    python benchmarks/precision_variants.py measure [--variants VARIANTS] [--only STEM ...] [--json-out PATH] [--flag F]
                                                    [--draws N] [--jobs N]
    python benchmarks/precision_variants.py nodes   [--variants VARIANTS] [--only STEM ...] [--refresh]
    python benchmarks/precision_variants.py latency [--variants VARIANTS] [--only STEM ...] [--runs N] [--json-out PATH]
    python benchmarks/precision_variants.py rules   [--variants VARIANTS] [--only STEM ...] [--jobs N] [--json-out PATH]

``build`` makes, with onnxruntime's own tools (the ones deployment engineers use; never a
dependency of graphopt), four variants of every export of DIR's index.json
(../shared/exports/build.py):

- ``fp16``: ``onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)``;
- ``qdq``: ``onnxruntime.quantization.quantize_static`` in QDQ format, calibrated on four inputs
  drawn as the index's first binding describes;
- ``dyn8``: ``quantize_dynamic`` (MatMulInteger and DynamicQuantizeLinear);
- ``int4``: ``MatMulNBitsQuantizer`` with blocks of 32;
- ``bf16``: the ``fp16`` conversion with every float16 tensor, type and Cast made bfloat16
  (tests/precision_models.py; no onnxruntime tool writes bfloat16), the ops whose schema takes no
  bfloat16 at the model's opset (Sin and Cos before 22) computed in float32 between Casts.
  onnxruntime's CPU provider runs no bfloat16 arithmetic: ``measure`` compares the float32 programs
  (graphopt's check does the same), ``latency`` skips them.

``--kinds`` builds only those variants; the index keeps the others. It also builds, on request only,
the other formats those tools write:

- ``qdq16``: ``quantize_static`` with int16 activations in onnxruntime's own QuantizeLinear and
  DequantizeLinear (``UseQDQContribOps``; QNN's format below opset 21);
- ``qdqpc``: ``quantize_static`` in QDQ format with per-channel weights;
- ``qop``: ``quantize_static`` in QOperator format (QLinearMatMul, QLinearConv, QLinearAdd, ...);
- ``int4qdq``: ``MatMulNBitsQuantizer`` in QDQ format (blocked int4 DequantizeLinear, opset 21);
- ``fp16io``: the float16 conversion with float16 inputs and outputs too (``keep_io_types=False``;
  ``measure`` feeds them the float32 draws rounded to float16);
- ``qdqu8``: ``quantize_static`` in QDQ format with uint8 activations (its default before onnxruntime 1.17);
- ``nbits8``: ``MatMulNBitsQuantizer`` with 8 bits (MatMulNBits ``bits=8``);
- ``int4asym``: ``MatMulNBitsQuantizer`` with zero points (asymmetric) and the embedding's Gather quantized too
  (GatherBlockQuantized);
- ``dyn8pc``: ``quantize_dynamic`` with per-channel weights;
- ``fp16int4``: the ``fp16`` conversion, then ``MatMulNBitsQuantizer`` (float16 activations and scales, 4-bit weights).

A variant the tool refuses is listed under "failed" with the tool's error. VARIANTS/index.json
has build.py's format (each entry gains ``variant`` and ``reference``: the float32 export it was
made from), so ``benchmarks/export_fusions.py --exports VARIANTS`` measures the variants too.

``measure`` runs graphopt on every variant in the three configurations (default, ``--target-opset
23``, ``--target ort``) with its numerics check, and compares independently at the index's bindings
(those at which onnxruntime runs the variant): the relative L2 distance of the variant's outputs to
the float32 export's and of graphopt's output to the float32 export's; their ratio says whether
graphopt moved the model away from what it approximates (1.0: no further than the variant itself
is). Each output is also run through graphopt's ``--check-optimized`` gate in the configuration that
wrote it (the "fixed point" column: a second run would change nothing). ``--draws N`` measures each
binding on N seeded inputs too and pools them, with a 95% bootstrap interval of the pooled ratio
(``distances``): one input's ratio moves a few percent either way by rounding alone, and an output
counts as further from the float32 export only beyond noise: more than 0.1% above 1 with the whole
interval above 1 and, where the variant has float inputs to round (images, audio; not token ids),
also further from it than the variant fed the same inputs rounded once more (each float input that is
no mask moved by up to half an ulp of the variant's compute precision, as graphopt's check moves the
original's for its own rounding: ``graphopt.numerics.noise``), the paired ratio's interval above 1. A
rewrite that rounds one activation differently moves a float16 model or a dynamically quantized one
(whole quantization steps downstream) as rounding its input does: vit_dynamo_dyn8 at opset 23 is 1.008
[1.0015, 1.016] of the variant's distance over 12 draws, the variant with its inputs rounded again
0.989 (1.003 with other moves), the output against that one 1.019 [0.997, 1.035]. The float32
export's, the variant's and the rounded variant's outputs are computed once per variant
(``Reference``). ``--jobs N`` measures N variants at once (the verdicts and distances do not depend
on the machine's load; the whole set, 443 variants at three targets, is about three hours in one job
on two cores).

``nodes`` counts the nodes of graphopt's default output and of every portable peer's (each tool
alone in a fresh process, as ``exports.py`` runs them; the peers' counts are kept in
~/.cache/graphopt-bench/variant-peers.json and rerun only with ``--refresh``) and prints, per
variant, graphopt's count, the best peer's and which of the two has more nodes.

``latency`` times, per variant, graphopt's default, ``--target-opset 23`` and ``--target ort`` outputs (written with the
check: the output a user gets, without the fusions through Q/DQ the check refuses) and
onnxruntime's extended-level output against the variant itself, at ORT_ENABLE_ALL, 1 thread, in
interleaved rounds at the index's second binding, or its first where onnxruntime refuses the
variant at the second (the users of these models measure them at onnxruntime's full level). Each figure is the median of
per-round ratios to the variant with its 95% bootstrap interval; an output is slower only beyond
noise (export_fusions.py's rule), against the variant and against onnxruntime's output, and not
against one that onnxruntime runs as the very same graph (``measure.session_graph``: the line names
those), where the difference is where the sessions landed in memory.

``rules`` runs graphopt without its check on the float16, QDQ, dynamic int8 and int4 variants at the three targets
and lists, per precision, every fuse rule that fired and what the fuse rules' table runs of it at that precision (its
columns of that name, ``python -m tests.passes.fuse.test_contract``): a rule that fires on a variant owes the table
its case at that precision, fired and perturbed, or the reason it has none.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/precision_models.py's bfloat16 retyping

from export_fusions import GRAPHOPT_CLI, ORT_OPS, STANDARD_OPS, TARGETS, _above, _ratio, op_counts
from exports import EXPORTS, best_peer, index_feeds
from exports import measure as peer_counts
from measure import interleaved_latency, node_count, session_graph
from tools import GRAPHOPT, PORTABLE_PEERS, run_tool

from graphopt.ir import DataType
from graphopt.numerics.inputs import read_spec
from graphopt.numerics.noise import Perturbation
from graphopt.numerics.reference import float_reference, holds_bfloat16
from graphopt.passes.rewrite.signatures import untaken
from tests.precision_tools import STATIC_KINDS, Calibration, bfloat16_of_float16, static_options

VARIANTS = Path.home() / ".cache/graphopt-exports-variants"
KINDS = ("fp16", "qdq", "dyn8", "int4", "bf16")
OTHER_KINDS = ("qdq16", "qdqpc", "qop", "int4qdq", "fp16io", "qdqu8", "nbits8", "int4asym", "dyn8pc", "fp16int4")
CALIBRATION_DRAWS = 4
VARIANT_PEER_CACHE = Path.home() / ".cache/graphopt-bench/variant-peers.json"
TIMEOUT_S = 900.0
BOOTSTRAP_RESAMPLES = 2000
ERROR_RATIO_NOISE = 0.001  # a pooled error ratio within 0.1% of 1 is the variant's error


# MatMulNBitsQuantizer's options per variant (blocks of 32; symmetric, 4 bits, the QOperator format unless said).
_NBITS: dict[str, dict[str, Any]] = {
    "int4": {},
    "int4qdq": {"quant_format": "QDQ"},
    "nbits8": {"bits": 8},
    "int4asym": {"is_symmetric": False, "op_types_to_quantize": ("MatMul", "Gather")},
    "fp16int4": {},  # of the float16 conversion
}


def make_variant(kind: str, entry: dict[str, Any], src: Path, dst: Path) -> None:
    """Write the ``kind`` variant of ``src`` to ``dst`` (raises what the tool raises)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.transformers.float16 import convert_float_to_float16

    if kind in ("fp16", "bf16", "fp16io"):
        model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=kind != "fp16io")
        onnx.save(_float32_where_untyped(bfloat16_of_float16(model)) if kind == "bf16" else model, str(dst))
    elif kind in STATIC_KINDS:
        calibration = Calibration(index_feeds(entry, 0, seed=seed) for seed in range(CALIBRATION_DRAWS))
        quantize_static(str(src), str(dst), calibration, **static_options(kind))
    elif kind in ("dyn8", "dyn8pc"):
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=kind == "dyn8pc")
    elif kind in _NBITS:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        model = onnx.load(str(src))
        if kind == "fp16int4":
            model = convert_float_to_float16(model, keep_io_types=True)
        options = {"bits": 4, "is_symmetric": True, "quant_format": "QOperator", **_NBITS[kind]}
        options["quant_format"] = getattr(QuantFormat, options["quant_format"])
        quantizer = MatMulNBitsQuantizer(model, block_size=32, **options)
        quantizer.process()
        quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)
    else:
        raise ValueError(f"unknown variant {kind!r}")


def _float32_where_untyped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (bfloat16) with each op whose schema takes no bfloat16 at its opset (Sin and Cos before opset 22)
    computed in float32 between Casts, as a bfloat16 export computes them."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *model.graph.input]}
    types |= {t.name: t.data_type for t in model.graph.initializer}
    bfloat16, nodes = onnx.TensorProto.BFLOAT16, []

    def typed(names: Any) -> list[DataType | None]:
        return [DataType(types[n]) if n in types else None for n in names]

    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or not untaken(
            node.op_type, opset, typed(node.input), typed(node.output)
        ):
            nodes.append(node)
            continue
        casts_after: list[onnx.NodeProto] = []
        for names, before in ((node.input, True), (node.output, False)):
            for index, name in enumerate(names):
                if types.get(name) == bfloat16:
                    wide = f"{name}_float32_{len(nodes)}"
                    cast = onnx.helper.make_node(
                        "Cast",
                        [name] if before else [wide],
                        [wide] if before else [name],
                        to=onnx.TensorProto.FLOAT if before else bfloat16,
                    )
                    (nodes if before else casts_after).append(cast)
                    names[index] = wide
        nodes += [node, *casts_after]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _rebuilt(entry: dict[str, Any], only: list[str], kinds: list[str]) -> bool:
    """Whether a build of ``kinds`` of the exports ``only`` names makes the variant of ``entry`` again."""
    stem, _, kind = Path(entry["file"]).stem.rpartition("_")
    return kind in kinds and (not only or entry["name"] in only or stem in only)


def build(exports: Path, out: Path, only: list[str], kinds: list[str]) -> int:
    index = json.loads((exports / "index.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Any] = {"versions": index.get("versions", {}), "models": [], "failed": []}
    if (out / "index.json").is_file():  # the variants not made again stay listed
        earlier = json.loads((out / "index.json").read_text())
        made["models"] = [e for e in earlier["models"] if not _rebuilt(e, only, kinds)]
        made["failed"] = [e for e in earlier["failed"] if not _rebuilt(e, only, kinds)]
    for entry in index["models"]:
        src = exports / entry["file"]
        if only and entry["name"] not in only and src.stem not in only:
            continue
        for kind in kinds:
            dst = out / f"{src.stem}_{kind}.onnx"
            try:
                make_variant(kind, entry, src, dst)
            except Exception as err:  # the tool's refusal is the finding
                error = f"{type(err).__name__}: {err}"
                made["failed"].append({"name": entry["name"], "file": dst.name, "error": error})
                print(f"{dst.name}: failed: {error[:200]}", flush=True)
                continue
            variant = {**entry, "file": dst.name, "variant": kind, "reference": str(src.resolve())}
            variant["nodes"] = node_count(dst).total
            variant["bytes"] = dst.stat().st_size
            made["models"].append(variant)
            print(f"{dst.name}: {variant['nodes']} nodes, {variant['bytes'] / 1e6:.1f} MB", flush=True)
    (out / "index.json").write_text(json.dumps(made, indent=1))
    print(f"{len(made['models'])} variants in {out}, {len(made['failed'])} refused by the tools")
    return 0


def _outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``path``'s outputs at ORT_DISABLE_ALL, 1 thread; a bfloat16 model's float32 program's (the check's float
    reference: onnxruntime's CPU provider runs no bfloat16 arithmetic)."""
    model = onnx.load(str(path))
    if holds_bfloat16(model.graph):
        program = float_reference(model)
        assert program is not None, f"{path}: no float32 program"
        return _session_outputs(program.SerializeToString(), feeds)
    return _session_outputs(str(path), _rounded_to_inputs(model, feeds))


def _rounded_to_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with the float32 draws of ``model``'s float16 inputs (fp16io) rounded to float16."""
    halves = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    return {name: value.astype(np.float16) if name in halves else value for name, value in feeds.items()}


def _session_outputs(model: str | bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return [np.asarray(o, dtype=np.float64) for o in session.run(None, {k: v for k, v in feeds.items() if k in wanted})]


def _squared_errors(found: list[np.ndarray], truth: list[np.ndarray]) -> np.ndarray:
    """Per output: the squared L2 distance of ``found`` to ``truth`` and the squared norm of ``truth``
    (finite positions of both only), shape (outputs, 2)."""
    sums = []
    for a, b in zip(found, truth, strict=True):
        both = np.isfinite(a) & np.isfinite(b)
        sums.append((float(np.sum((a[both] - b[both]) ** 2)), float(np.sum(b[both] ** 2))))
    return np.asarray(sums, dtype=np.float64).reshape(len(sums), 2)


def _worst_rel_l2(sums: np.ndarray) -> np.ndarray:
    """The worst relative L2 distance over the outputs (and bindings) from ``_squared_errors`` sums
    (last axis: distance, norm; the axis before: outputs); leading axes are kept."""
    norms = np.where(sums[..., 1] > 0, sums[..., 1], 1.0)
    return np.sqrt(sums[..., 0] / norms).max(axis=-1)


class Reference:
    """The float32 export's and the variant's outputs at every binding on ``draws`` seeded inputs
    each, and the variant's with those inputs rounded once more (``rounds``: measured, with more than
    one draw and a float input to round), computed once per variant and compared with each of
    graphopt's outputs."""

    def __init__(self, entry: dict[str, Any], variant: Path, draws: int) -> None:
        self.entry, self.draws, self.skipped = entry, draws, 0
        # The precision the check's own-rounding draws move the original by (ModelSpec.compute_precision).
        rounding = Perturbation(read_spec(variant).compute_precision())
        rng = np.random.default_rng(0)
        self.rounds = draws > 1  # only the pooled verdict reads them
        self.runs: list[list[tuple[dict[str, np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray]]]] = []
        for binding in range(len(entry["feeds"])):
            runs = []
            for seed in range(draws):
                feeds = index_feeds(entry, binding, seed)
                try:
                    mine = _outputs(variant, feeds)
                except Exception:  # onnxruntime refused the variant itself there
                    if seed == 0 and binding == len(entry["feeds"]) - 1 and self.skipped == binding:
                        raise
                    self.skipped += seed == 0
                    break
                moved = {name: np.asarray(value) for name, value in rounding.feed(feeds, rng).items()}
                self.rounds &= any(moved[name] is not feeds[name] for name in feeds)
                rounded = _outputs(variant, moved) if self.rounds else mine
                runs.append((feeds, _outputs(Path(entry["reference"]), feeds), mine, rounded))
            if runs:
                self.runs.append(runs)
        self.draws = min([draws, *(len(runs) for runs in self.runs)])  # the variant failed at a later draw


def distances(reference: Reference, optimized: Path) -> dict[str, Any]:
    """The variant's and the optimized model's worst distance to the float32 export, over the
    bindings at which the variant runs (``skipped``: the others; the QDQ T5 encoders' quantized
    relative positions index out of their table past 16 tokens). Raises where it runs at none.

    With more than one draw, also ``pooled``: the same distances over the draws of each binding
    taken together (one relative L2 of all their outputs at once), and ``ratio_interval``: a 95%
    bootstrap interval of the pooled ratio, the draws resampled (paired: the variant and the
    optimized model on the same inputs). A float16 or quantized model's distance to its float32
    export moves by a few percent from one input to the next, and a rewrite's rounding moves it as
    much either way (vit_ts_fp16 at opset 23: 0.95 to 1.08 of the variant's over 12 inputs; BERT's
    256-value pooled output: 1.007 over 24 draws, 1.000 over 96); the optimized model is further
    from the float32 export than the variant only where the whole interval is above 1."""
    # sums[binding, draw, model (variant, optimized, rounded variant), output, (distance, norm)]
    sums = np.asarray(
        [
            [
                [_squared_errors(found, truth) for found in (mine, _outputs(optimized, feeds), rounded)]
                for feeds, truth, mine, rounded in runs[: reference.draws]
            ]
            for runs in reference.runs
        ]
    )
    models = sums.shape[2]
    first = _worst_rel_l2(sums[:, 0].transpose(1, 0, 2, 3).reshape(models, -1, 2))
    found: dict[str, Any] = {"variant": float(first[0]), "optimized": float(first[1]), "skipped": reference.skipped}
    if reference.draws > 1:
        pooled = _worst_rel_l2(sums.sum(axis=1).transpose(1, 0, 2, 3).reshape(models, -1, 2))
        picks = np.random.default_rng(0).integers(0, reference.draws, (BOOTSTRAP_RESAMPLES, reference.draws))
        drawn = sums[:, picks].sum(axis=2)  # binding, resample, model, output, 2
        worst = _worst_rel_l2(drawn.transpose(1, 2, 0, 3, 4).reshape(BOOTSTRAP_RESAMPLES, models, -1, 2))
        found["pooled"] = {
            "variant": float(pooled[0]),
            "optimized": float(pooled[1]),
            "draws": reference.draws,
            "ratio_interval": _interval(worst[:, 1] / worst[:, 0]),
        }
        if reference.rounds:
            found["pooled"]["rounded"] = float(pooled[2])
            found["pooled"]["rounded_interval"] = _interval(worst[:, 1] / worst[:, 2])
    return found


def _interval(ratios: np.ndarray) -> list[float]:
    """The 95% interval of bootstrapped ratios."""
    return [float(bound) for bound in np.percentile(ratios, [2.5, 97.5])]


def _error_ratio(dist: dict[str, Any] | None) -> float | None:
    """The optimized model's distance to the float32 export over the variant's (pooled where measured)."""
    if not dist:
        return None
    measured = dist.get("pooled", dist)
    return measured["optimized"] / measured["variant"] if measured["variant"] else None


def _further_beyond_noise(dist: dict[str, Any] | None) -> bool:
    """True where the pooled error ratio is more than ERROR_RATIO_NOISE above 1 and its whole interval above 1
    (export_fusions.py's rule for latency: the dynamic int8 Llamas' opset-23 outputs measured 1.00015
    [1.000000004, 1.0004], the same error to four decimals), and so is the ratio to the variant with its inputs
    rounded once more, where measured."""
    ratio, pooled = _error_ratio(dist), (dist or {}).get("pooled") or {}
    if ratio is None or "ratio_interval" not in pooled:
        return False
    further = ratio > 1 + ERROR_RATIO_NOISE and pooled["ratio_interval"][0] > 1
    if "rounded" in pooled:
        rounded = pooled["optimized"] / pooled["rounded"]
        further &= rounded > 1 + ERROR_RATIO_NOISE and pooled["rounded_interval"][0] > 1
    return further


def _loads_at_full_level(path: Path) -> bool | str:
    """True where onnxruntime loads ``path`` at ORT_ENABLE_ALL (its users' default), else its refusal."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's refusal, recorded
        return str(err)[:200]
    return True


def graphopt_report(src: Path, out: Path, flags: list[str]) -> tuple[int, dict[str, Any] | str]:
    """graphopt's exit code on ``src`` (writing ``out``) and its JSON report, or the last line it wrote on stderr
    where it wrote no report."""
    cmd = [str(GRAPHOPT_CLI), "run", str(src), "-o", str(out), "--json", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        return done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def run_graphopt(src: Path, out: Path, flags: list[str]) -> dict[str, Any]:
    """graphopt's exit code, its check's verdict and criterion, its seconds and the fusions through Q/DQ it
    withdrew on ``src``."""
    code, report = graphopt_report(src, out, flags)
    found: dict[str, Any] = {"exit": code}
    if isinstance(report, str):
        found["error"] = report
        return found
    numerics = report.get("numerics") or {}
    found["seconds"] = (report.get("seconds") or {}).get("total")
    if report.get("through_qdq"):
        found["through_qdq"] = report["through_qdq"]
    found["check"] = numerics.get("status")
    found["criterion"] = numerics.get("passed_by")  # fixed tolerance, own rounding, float reference
    if numerics.get("status") != "passed":
        found["reason"] = numerics.get("reason")
    return found


def is_fixed_point(out: Path, flags: list[str]) -> bool:
    """Whether graphopt's ``--check-optimized`` gate, in the configuration that wrote ``out``, passes on it: a CI
    that runs the gate on the models it committed after optimizing them relies on it."""
    cmd = [str(GRAPHOPT_CLI), "run", str(out), "--check-optimized", "-q", *flags]
    return subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, check=False).returncode == 0


def selected(variants: Path, only: list[str]) -> Iterator[tuple[dict[str, Any], Path]]:
    """The index entries of ``variants`` that ``only`` names (all when empty), with their files."""
    for entry in json.loads((variants / "index.json").read_text())["models"]:
        src = variants / entry["file"]
        if not only or src.stem in only or entry["name"] in only:
            yield entry, src


def measure(variants: Path, only: list[str], extra: list[str], draws: int = 1, jobs: int = 1) -> list[dict[str, Any]]:
    """A row per variant (index order), each printed as it is done; ``jobs`` variants at once."""
    chosen = list(selected(variants, only))
    rows: list[dict[str, Any] | None] = [None] * len(chosen)
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        running = {pool.submit(measure_variant, entry, src, extra, draws): at for at, (entry, src) in enumerate(chosen)}
        for done in concurrent.futures.as_completed(running):
            rows[running[done]] = row = done.result()
            print(_line(row), flush=True)
    return [row for row in rows if row is not None]


def measure_variant(entry: dict[str, Any], src: Path, extra: list[str], draws: int) -> dict[str, Any]:
    """graphopt on one variant in the three configurations, with its check, and each output's distance to the
    float32 export against the variant's."""
    row: dict[str, Any] = {"model": src.stem, "variant": entry["variant"], "original": node_count(src).total}
    reference: Reference | str | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for target, flags in TARGETS.items():
            out = Path(tmp) / f"{src.stem}.{target}.onnx"
            cell = run_graphopt(src, out, [*flags, *extra])
            if out.is_file():
                cell["fixed_point"] = is_fixed_point(out, [*flags, *extra])
                cell["loads"] = _loads_at_full_level(out)
                cell["nodes"] = node_count(out).total
                counts = op_counts(out)
                cell["fused"] = {op: counts[op] for op in [*STANDARD_OPS, *ORT_OPS] if counts[op]}
                if reference is None:
                    try:
                        reference = Reference(entry, src, draws)
                    except Exception as err:  # onnxruntime refused the variant at every binding: recorded
                        reference = f"{type(err).__name__}: {str(err)[:200]}"
                if isinstance(reference, str):
                    cell["distance_error"] = reference
                else:
                    try:
                        cell["distance"] = distances(reference, out)
                    except Exception as err:  # onnxruntime refused the output at a binding: recorded, not fatal
                        cell["distance_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            row[target] = cell
    return row


def _line(row: dict[str, Any]) -> str:
    cells = []
    for target in TARGETS:
        cell = row[target]
        dist = cell.get("distance")
        ratio = f"{dist['optimized'] / dist['variant']:.3f}" if dist and dist["variant"] else "-"
        pooled = _error_ratio(dist)
        if dist and "pooled" in dist and pooled is not None:
            low, high = dist["pooled"]["ratio_interval"]
            ratio += f" (over {dist['pooled']['draws']} draws {pooled:.3f} [{low:.3f}, {high:.3f}]"
            if "rounded" in dist["pooled"]:
                rounded = dist["pooled"]["rounded"] / dist["pooled"]["variant"]
                ratio += f", the variant with its inputs rounded again {rounded:.3f}"
            ratio += ")"
        fused = ",".join(f"{op}x{n}" for op, n in cell.get("fused", {}).items())
        withdrawn = cell.get("through_qdq")
        retried = f" withdrew {withdrawn['withdrawn']} ({','.join(withdrawn['families'])})" if withdrawn else ""
        retried += " NOT A FIXED POINT" if cell.get("fixed_point") is False else ""
        cells.append(
            f"{target}: exit {cell['exit']} {cell.get('check')} ({cell.get('criterion')}) "
            f"{row['original']}->{cell.get('nodes')} err-ratio {ratio} [{fused}]{retried}"
        )
    return f"{row['model']}: " + " | ".join(cells)


def summary(rows: list[dict[str, Any]]) -> str:
    """Counts per variant kind: runs, exit 0 with the check passed (by which criterion), the
    outputs onnxruntime loads at ORT_ENABLE_ALL, the worst error ratio (pooled over the draws where
    measured with --draws), the outputs further from the float32 export than the variant beyond
    noise (``_further_beyond_noise``), and the attention ops written: Attention at opset 23,
    MultiHeadAttention or GroupQueryAttention at ort."""
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    worst: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        counts = by_kind[row["variant"]]
        for target in TARGETS:
            cell = row[target]
            counts["runs"] += 1
            passed = cell["exit"] == 0 and cell.get("check") == "passed"
            counts["passed"] += passed
            if passed:
                counts[f"by {cell.get('criterion')}"] += 1
            ratio = _error_ratio(cell.get("distance"))
            if ratio is not None:
                worst[row["variant"]] = max(worst[row["variant"]], ratio)
            counts["further beyond noise"] += _further_beyond_noise(cell.get("distance"))
            counts["loads at ORT_ENABLE_ALL"] += cell.get("loads") is True
            counts["fixed point"] += cell.get("fixed_point") is True
        fused = row["opset23"].get("fused", {}), row["ort"].get("fused", {})
        counts["attention"] += fused[0].get("Attention", 0)
        counts["ort attention"] += fused[1].get("MultiHeadAttention", 0) + fused[1].get("GroupQueryAttention", 0)
    lines = [
        "| variant | runs | exit 0, check passed | fixed point | loads at ORT_ENABLE_ALL | passed by "
        "| worst error ratio to float32 | further beyond noise | Attention (opset 23) | MHA or GQA (ort) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, counts in sorted(by_kind.items()):
        by = ", ".join(f"{key[3:]} {n}" for key, n in sorted(counts.items()) if key.startswith("by "))
        lines.append(
            f"| {kind} | {counts['runs']} | {counts['passed']} | {counts['fixed point']} "
            f"| {counts['loads at ORT_ENABLE_ALL']} | {by} "
            f"| {worst[kind]:.3f} | {counts['further beyond noise']} "
            f"| {counts['attention']} | {counts['ort attention']} |"
        )
    return "\n".join(lines)


def node_table(rows: list[dict[str, Any]]) -> str:
    """One line per export, one column per variant kind: graphopt's default output against the
    best portable peer (named), and which of the two has more nodes; then the tally."""
    cells: dict[str, dict[str, str]] = collections.defaultdict(dict)
    tally: collections.Counter[str] = collections.Counter()
    for row in rows:
        export, _, kind = row["model"].rpartition("_")
        best, ours = best_peer(row), row.get(GRAPHOPT)
        if best is None or not isinstance(ours, int):
            verdict = "not measured"
        else:
            verdict = "graphopt more" if ours > best[1] else "peer more" if ours < best[1] else "tie"
        tally[verdict] += 1
        peer = f"{best[1]} {best[0]}" if best else "-"
        mark = "**" if verdict == "graphopt more" else ""
        cells[export][kind] = f"{mark}{ours} / {peer}{mark}"
    kinds = [kind for kind in (*KINDS, *OTHER_KINDS) if any(kind in found for found in cells.values())]
    lines = [
        "| export | " + " | ".join(f"{kind}: graphopt / best peer" for kind in kinds) + " |",
        "|---" * (len(kinds) + 1) + "|",
    ]
    lines += [
        f"| {export} | " + " | ".join(found.get(kind, "-") for kind in kinds) + " |" for export, found in cells.items()
    ]
    lines.append(
        f"\n{len(rows)} variants: graphopt fewer nodes than the best portable peer on {tally['peer more']}, "
        f"as many on {tally['tie']}, more on {tally['graphopt more']} (in bold)"
        + (f", not measured on {tally['not measured']}" if tally["not measured"] else "")
    )
    return "\n".join(lines)


# The precisions of the fuse rules' table (tests/passes/fuse/test_precision.py) by variant kind (the table makes its
# float16 cases with float16 inputs and outputs, as fp16io is built).
TABLE_PRECISIONS = {"fp16": "float16", "fp16io": "float16", "qdq": "qdq", "dyn8": "dyn8", "int4": "int4"}


def rules_fired(variants: Path, only: list[str], jobs: int) -> list[dict[str, Any]]:
    """A row per variant of a precision of the fuse rules' table (fp16, fp16io, qdq, dyn8, int4): the fuse rules
    graphopt applied on it at each target, with no check (the check only withdraws rules, so this is every rule that
    can fire there)."""
    chosen = [(entry, src) for entry, src in selected(variants, only) if entry["variant"] in TABLE_PRECISIONS]
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_rules_of_variant, *zip(*chosen, strict=True))) if chosen else []


def _rules_of_variant(entry: dict[str, Any], src: Path) -> dict[str, Any]:
    """The rules graphopt applied on ``src`` by target, how often each (graphopt's error where a run wrote no
    report, under "errors")."""
    row: dict[str, Any] = {"model": src.stem, "variant": entry["variant"], "errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for target, flags in TARGETS.items():
            _, report = graphopt_report(src, Path(tmp) / "out.onnx", ["--no-check", *flags])
            applied: collections.Counter[str] = collections.Counter()
            if isinstance(report, str):
                row["errors"][target] = report
            else:
                for ran in report["passes"]:
                    applied.update((ran.get("details") or {}).get("applied") or {})
            row[target] = dict(applied)
    rewrites = sum(sum(row[target].values()) for target in TARGETS)
    print(f"{row['model']}: {rewrites} rewrites" + (f", failed: {row['errors']}" if row["errors"] else ""), flush=True)
    return row


def rules_table(rows: list[dict[str, Any]]) -> str:
    """Per precision of the fuse rules' table, every fuse rule that fired on a variant of it (on how many files,
    and one of them), and what the table runs of it there (tests/passes/fuse/test_contract.py's column; "-": no
    case at that precision, which the table owes every rule that fires on a variant)."""
    from graphopt.passes.fuse import registered_rules
    from tests.passes.fuse.test_contract import precision_cell

    fuse_rules = {rule.name for rule in registered_rules()}
    lines: list[str] = []
    for kind, precision in TABLE_PRECISIONS.items():
        if not any(row["variant"] == kind for row in rows):
            continue
        fired: dict[str, set[str]] = collections.defaultdict(set)
        for row in rows:
            if row["variant"] == kind:
                for target in TARGETS:
                    for rule in row.get(target, {}):
                        if rule in fuse_rules:
                            fired[rule].add(f"{row['model']} ({target})")
        cells = {rule: precision_cell(rule, precision) for rule in sorted(fired)}
        lines += [f"\n{precision}:", "| rule | files | e.g. | the table at this precision |", "|---|---|---|---|"]
        lines += [f"| {rule} | {len(fired[rule])} | {min(fired[rule])} | {cells[rule]} |" for rule in cells]
        missing = [rule for rule, cell in cells.items() if cell == "-"]
        lines.append(
            f"{len(cells)} rules fire on the {kind} variants; without a case at {precision}: "
            + (", ".join(missing) if missing else "none")
        )
    failed = [f"{row['model']} ({target}): {error}" for row in rows for target, error in row["errors"].items()]
    lines.append("\ngraphopt wrote no report (its rules unknown) on: " + ("; ".join(failed) if failed else "none"))
    return "\n".join(lines)


TIMED = {"default": [], "opset23": ["--target-opset", "23"], "ort": ["--target", "ort"]}
# The columns of the latency table: the three outputs, then onnxruntime's own.
_TIMED_COLUMNS = {
    "default": "default",
    "opset23": "`--target-opset 23`",
    "ort": "`--target ort`",
    "ort_extended": "ort_extended",
}


def latency(variants: Path, only: list[str], runs: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry, src in selected(variants, only):
            if entry["variant"] == "bf16":
                print(f"{src.stem}: not timed (onnxruntime's CPU provider runs no bfloat16 arithmetic)", flush=True)
                continue
            models = {"variant": src}
            for target, flags in TIMED.items():
                out = Path(tmp) / f"{src.stem}.{target}.onnx"
                subprocess.run(  # with the check: the output a user gets (a refused fusion withdrawn)
                    [str(GRAPHOPT_CLI), "run", str(src), "-o", str(out), "-q", *flags],
                    capture_output=True,
                    timeout=TIMEOUT_S,
                    check=False,
                )
                models[target] = out
            models["ort_extended"] = Path(tmp) / f"{src.stem}.ort_extended.onnx"
            run_tool("ort_extended", src, models["ort_extended"], timeout=TIMEOUT_S, check=False)
            feeds = _last_running(entry, src)
            row: dict[str, Any] = {"model": src.stem, "variant": entry["variant"], "load": os.getloadavg()[0]}
            row["latency"] = interleaved_latency(
                {key: path for key, path in models.items() if path.is_file()},
                feeds,
                "ORT_ENABLE_ALL",
                runs=runs,
                warmup=max(2, runs // 10),
            )
            row["same_session_graph"] = _same_session_graphs(models, row["latency"])
            for path in models.values():
                if path != src:
                    path.unlink(missing_ok=True)
            print(_latency_line(row), flush=True)
            rows.append(row)
    return rows


def _last_running(entry: dict[str, Any], variant: Path) -> dict[str, np.ndarray]:
    """The feeds of the index's last binding at which ``variant`` runs (the last one, unless
    onnxruntime refuses the variant itself there)."""
    for binding in reversed(range(len(entry["feeds"]))):
        feeds = index_feeds(entry, binding)
        try:
            _outputs(variant, feeds)
        except Exception:  # the QDQ T5 encoders' quantized relative positions, past 16 tokens
            continue
        break
    else:
        feeds = index_feeds(entry, len(entry["feeds"]) - 1)
    return _rounded_to_inputs(onnx.load(str(variant)), feeds)


def _same_session_graphs(models: dict[str, Path], timed: dict[str, Any]) -> dict[str, list[str]]:
    """Per output timed slower beyond noise than the variant or onnxruntime's output: which of those two
    onnxruntime runs as the very same graph (``session_graph``), where the difference is where the sessions
    landed in memory, not the files."""
    same: dict[str, list[str]] = {}
    graphs: dict[str, list[tuple[str, ...]]] = {}  # each file's session graph built once

    def graph_of(key: str) -> list[tuple[str, ...]]:
        if key not in graphs:
            graphs[key] = session_graph(models[key])
        return graphs[key]

    references = {"variant": None, "ort_extended": timed.get("ort_extended")}
    for target in TIMED:
        slower = [other for other, reference in references.items() if _above(timed.get(target), reference)]
        if slower:
            same[target] = [other for other in slower if graph_of(other) == graph_of(target)]
    return same


def _slower(row: dict[str, Any], target: str) -> list[str]:
    """What ``target``'s output is slower than, beyond noise: the variant, onnxruntime's output; not one that
    onnxruntime runs as the same graph."""
    found, timed = [], row["latency"]
    same = row.get("same_session_graph", {}).get(target, [])
    if _above(timed.get(target)) and "variant" not in same:
        found.append("the variant")
    if _above(timed.get(target), timed.get("ort_extended")) and "ort_extended" not in same:
        found.append("ort_extended")
    return found


def _slower_targets(row: dict[str, Any]) -> list[str]:
    return [f"{target} slower than {' and '.join(_slower(row, target))}" for target in TIMED if _slower(row, target)]


def _latency_line(row: dict[str, Any]) -> str:
    timed = row["latency"]
    base = timed.get("variant")
    ms = f"{base['median_s'] * 1000:.2f} ms" if isinstance(base, dict) else "err"
    cells = [f"{key} {_ratio(timed.get(key))}" for key in _TIMED_COLUMNS]
    slower = _slower_targets(row)
    same_graphs = row.get("same_session_graph", {})
    same = [f"{target} as {' and '.join(others)}" for target, others in same_graphs.items() if others]
    return (
        f"{row['model']}: variant {ms}; "
        + "; ".join(cells)
        + (f"  ** {'; '.join(slower)}" if slower else "")
        + (f"  (timed slower, the same session graph: {'; '.join(same)})" if same else "")
    )


def latency_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | variant ms | "
        + " | ".join(f"{label} / variant" for label in _TIMED_COLUMNS.values())
        + " | slower beyond noise |",
        "|---" * (len(_TIMED_COLUMNS) + 3) + "|",
    ]
    tally: collections.Counter[str] = collections.Counter()
    for row in rows:
        timed = row["latency"]
        base = timed.get("variant")
        slower = _slower_targets(row)
        tally["rows"] += 1
        tally["slower"] += bool(slower)
        cells = " | ".join(_ratio(timed.get(key)) for key in _TIMED_COLUMNS)
        ms = f"{base['median_s'] * 1000:.2f}" if isinstance(base, dict) else "err"
        lines.append(f"| {row['model']} | {ms} | {cells} | {'; '.join(slower) or '-'} |")
    lines.append(f"\n{tally['rows']} variants; an output slower beyond noise on {tally['slower']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "measure", "nodes", "latency", "rules"])
    parser.add_argument("--exports", type=Path, default=EXPORTS, help="the float32 exports with their index.json")
    parser.add_argument("--variants", "--out", dest="variants", type=Path, default=VARIANTS, help="the variants folder")
    parser.add_argument("--only", nargs="*", default=[], help="model names or file stems")
    parser.add_argument(
        "--kinds", nargs="*", default=list(KINDS), choices=[*KINDS, *OTHER_KINDS], help="build: the variants to make"
    )
    parser.add_argument("--json-out", type=Path, help="measure, nodes: also save the rows as JSON")
    parser.add_argument(
        "--flag", action="append", default=[], help="measure: a graphopt option added to every run (repeatable)"
    )
    parser.add_argument("--refresh", action="store_true", help="nodes: rerun the peers instead of reading their cache")
    parser.add_argument("--runs", type=int, default=40, help="latency: timed interleaved rounds (default 40)")
    parser.add_argument(
        "--draws",
        type=int,
        default=1,
        help="measure: seeded inputs per binding for the error ratio, also pooled over them (default 1: the index's)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="measure, rules: variants run at once (default 1; latency is always measured one file at a time)",
    )
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error("--draws must be at least 1")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.action == "build":
        if not (args.exports / "index.json").is_file():
            print(f"no index.json in {args.exports}: build the exports first (../shared/exports/build.py, needs torch)")
            return 2
        return build(args.exports, args.variants, args.only, args.kinds)
    if not (args.variants / "index.json").is_file():
        print(f"no index.json in {args.variants}: run `precision_variants.py build` first")
        return 2
    if args.action == "nodes":
        tools = [GRAPHOPT, *PORTABLE_PEERS]
        rows = peer_counts(args.variants, args.only, tools, args.refresh, check=False, cache_path=VARIANT_PEER_CACHE)
    elif args.action == "latency":
        rows = latency(args.variants, args.only, args.runs)
    elif args.action == "rules":
        rows = rules_fired(args.variants, args.only, args.jobs)
    else:
        rows = measure(args.variants, args.only, args.flag, args.draws, args.jobs)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    tables = {"nodes": node_table, "latency": latency_table, "measure": summary, "rules": rules_table}
    print(tables[args.action](rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
