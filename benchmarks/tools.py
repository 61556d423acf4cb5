"""Run one optimizer on one model file, alone in a fresh process, and measure it.

    python benchmarks/tools.py TOOL IN.onnx OUT.onnx [--passes P] [--check]

prints one JSON line: the seconds inside the tool (after its imports: load, optimize, save,
and the optimize call alone), the process's peak RSS (VmHWM, read before the optional
numerics check so the check does not count), and with ``--check`` the verdict of
graphopt's numerics check of OUT against IN. The parent (bench.py) calls :func:`run_tool`,
which turns a crash, a timeout or an unparsable answer into an error record instead of
raising.

Every tool is timed file to file (load, optimize, save), because that is the call a user
makes and graphopt's ``optimize_file`` is one call that does all three; the optimize step
alone is recorded beside it as ``call_seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GRAPHOPT = "graphopt"

# The workspace's shared/ folder sits beside the repository (a clone elsewhere falls back to /work).
BUILDER = next(
    (
        p
        for p in (Path(__file__).resolve().parents[2] / "shared/corpus/build.py", Path("/work/shared/corpus/build.py"))
        if p.is_file()
    ),
    Path("/work/shared/corpus/build.py"),
)
# The peers, in table order. ort_extended writes onnxruntime's contrib ops, which only
# onnxruntime can run, so it is shown beside the others but never counted as "best peer".
PEERS = ["onnxsim", "onnxslim", "onnxoptimizer", "onnxscript", "ort_basic", "ort_extended"]
PORTABLE_PEERS = PEERS[:-1]
# onnxruntime-only peers besides ort_extended, run by tune_accept.py (not by `make bench`):
# onnxscript's fusions for onnxruntime and onnxruntime's transformers optimizer.
ORT_PEERS = ["onnxscript_ort", "ort_transformers"]
TOOLS = [GRAPHOPT, *PEERS]


@dataclass
class ToolRun:
    """What one tool did to one model; ``error`` set means the other fields are not to be trusted."""

    tool: str
    seconds: float | None = None
    call_seconds: float | None = None
    peak_rss_mb: float | None = None
    output: str | None = None
    error: str | None = None
    check: str | None = None
    check_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def peak_rss_mb() -> float:
    """This process's high-water RSS in MB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the tools, each (imports, then a timed file-to-file run) -------------------------------
# A runner returns (call seconds, notes); the caller times the whole of it.

Runner = Callable[[Path, Path, argparse.Namespace], tuple[float, list[str]]]


def _graphopt(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
    from graphopt.runner import RunOptions, optimize_file

    passes = args.passes if args.passes is not None else existing_default_pipeline()
    report, _ = optimize_file(src, RunOptions.resolve(passes, output=out, check=False))
    notes = [f"pass {f['pass']} failed: {f['error']}" for f in report.get("failures", [])]
    if passes is not None and args.passes is None:
        notes.append("default pipeline without the passes not written yet: " + ", ".join(missing_passes()))
    return float(report["seconds"]["optimize"]), notes


def _prune(entries: list[Any], keep: Callable[[str], bool]) -> list[Any]:
    """A pipeline config without the passes ``keep`` rejects (and without groups left empty)."""
    kept = []
    for entry in entries:
        if "group" in entry:
            steps = _prune(entry["steps"], keep)
            if steps:
                kept.append({**entry, "steps": steps})
        elif keep(entry["pass"]):
            kept.append(entry)
    return kept


def _pass_names(entries: list[Any]) -> list[str]:
    return [name for e in entries for name in (_pass_names(e["steps"]) if "group" in e else [e["pass"]])]


def missing_passes() -> list[str]:
    from graphopt.passes import all_passes
    from graphopt.passes.pipeline import DEFAULT_PIPELINE

    return [name for name in _pass_names(DEFAULT_PIPELINE) if name not in all_passes()]


def existing_default_pipeline() -> Any:
    """None while every pass of the default pipeline is registered; else the pipeline of those that are.

    Other people write the passes while the bench runs; a pass not registered yet must not
    turn graphopt's whole column into errors. The note in the result says what was left out.
    """
    from graphopt.passes import all_passes
    from graphopt.passes.pipeline import DEFAULT_PIPELINE, pipeline_from_config

    if not missing_passes():
        return None
    return pipeline_from_config(_prune(DEFAULT_PIPELINE, lambda name: name in all_passes()))


def _proto_tool(optimize: Callable[[Any], Any]) -> Runner:
    """A peer that maps a ModelProto to a ModelProto: onnx.load, the call, onnx.save."""

    def run(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
        import onnx

        model = onnx.load(str(src))
        start = time.perf_counter()
        optimized = optimize(model)
        call = time.perf_counter() - start
        large = optimized.ByteSize() > 2**31 - 2**26
        onnx.save(optimized, str(out), save_as_external_data=large, location=f"{out.name}.data")
        return call, []

    return run


def _onnxsim(model: Any) -> Any:
    import onnxsim

    optimized, _ = onnxsim.simplify(model)
    return optimized


def _onnxslim(model: Any) -> Any:
    import onnxslim

    return onnxslim.slim(model)


def _onnxoptimizer(model: Any) -> Any:
    import onnxoptimizer

    return onnxoptimizer.optimize(model, onnxoptimizer.get_fuse_and_elimination_passes())


def _onnxscript(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
    # onnxscript works on onnx_ir models; its own loader is its fastest path in and out.
    import onnx_ir
    from onnxscript import optimizer

    model = onnx_ir.load(str(src))
    start = time.perf_counter()
    optimizer.optimize(model)
    call = time.perf_counter() - start
    onnx_ir.save(model, str(out))
    return call, []


def _onnxscript_ort(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
    import onnx_ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = onnx_ir.load(str(src))
    start = time.perf_counter()
    _, fusions = optimize_for_ort(model)
    call = time.perf_counter() - start
    onnx_ir.save(model, str(out))
    return call, [f"fusions: {', '.join(f'{k} {v}' for k, v in sorted(fusions.items()) if v)}"]


def _ort_transformers(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
    # Its onnxruntime step (optimize_by_onnxruntime) imports torch, which the bench extras do
    # not install: the same step is run here (the model type's default level, on the CPU
    # provider) and the Python fusions after it (opt_level 0). num_heads / hidden_size 0:
    # the optimizer reads them from the graph.
    import tempfile

    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import MODEL_TYPES, optimize_model

    start = time.perf_counter()
    level = MODEL_TYPES[args.model_type][2]
    with tempfile.TemporaryDirectory() as folder:
        source = str(src)
        if level:
            options = ort.SessionOptions()
            options.graph_optimization_level = (
                ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                if level == 1
                else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            )
            options.optimized_model_filepath = source = str(Path(folder) / "basic.onnx")
            ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
        optimized = optimize_model(source, model_type=args.model_type, num_heads=0, hidden_size=0, opt_level=0)
    call = time.perf_counter() - start
    optimized.save_model_to_file(str(out))
    return call, [f"model type {args.model_type} (onnxruntime level {level} first)"]


def _ort(level_name: str) -> Runner:
    def run(src: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[str]]:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level_name)
        options.optimized_model_filepath = str(out)
        options.intra_op_num_threads = 1
        start = time.perf_counter()
        ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
        return time.perf_counter() - start, []

    return run


RUNNERS: dict[str, Runner] = {
    GRAPHOPT: _graphopt,
    "onnxsim": _proto_tool(_onnxsim),
    "onnxslim": _proto_tool(_onnxslim),
    "onnxoptimizer": _proto_tool(_onnxoptimizer),
    "onnxscript": _onnxscript,
    "ort_basic": _ort("ORT_ENABLE_BASIC"),
    "ort_extended": _ort("ORT_ENABLE_EXTENDED"),
    "onnxscript_ort": _onnxscript_ort,
    "ort_transformers": _ort_transformers,
}

# Imported before the clock starts: import time is not the tool's optimize time.
_IMPORTS = {
    GRAPHOPT: [
        "graphopt.api",
        "graphopt.runner",
        "graphopt.io.onnx_infer",
        "graphopt.evaluate",
    ],
    "onnxsim": ["onnx", "onnxsim"],
    "onnxslim": ["onnx", "onnxslim"],
    "onnxoptimizer": ["onnx", "onnxoptimizer"],
    "onnxscript": ["onnx_ir", "onnxscript.optimizer"],
    "ort_basic": ["onnxruntime"],
    "ort_extended": ["onnxruntime"],
    "onnxscript_ort": ["onnx_ir", "onnxscript.rewriter.ort_fusions"],
    "ort_transformers": ["onnxruntime.transformers.optimizer"],
}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    for module in _IMPORTS[args.tool]:
        importlib.import_module(module)
    if args.tool == GRAPHOPT:  # its pass families load on first use: import time too
        from graphopt.passes.base import all_passes

        all_passes()
    src, out = Path(args.src), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    call, notes = RUNNERS[args.tool](src, out, args)
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "seconds": seconds,
        "call_seconds": call,
        "peak_rss_mb": peak_rss_mb(),
        "notes": notes,
    }
    if args.check:
        from graphopt.numerics import check_models

        dims = dict(item.split("=", 1) for item in args.dim)
        dims_given = {k: int(v) for k, v in dims.items()} or None
        outcome = check_models(src, out, dims=dims_given, atol=args.atol, rtol=args.rtol)
        result["check"] = outcome.status
        result["check_reason"] = outcome.reason
    return result


# -- the parent's side --------------------------------------------------------------------


def run_tool(
    tool: str,
    src: Path,
    out: Path,
    *,
    timeout: float,
    passes: str | None = None,
    check: bool = True,
    dims: dict[str, int] | None = None,
    tolerance: tuple[float, float] | None = None,
    model_type: str | None = None,
) -> ToolRun:
    """Run ``tool`` on ``src`` into ``out`` in a fresh interpreter; never raises for the tool's faults."""
    cmd = [sys.executable, str(Path(__file__).resolve()), tool, str(src), str(out)]
    if passes:
        cmd += ["--passes", passes]
    if check:
        cmd.append("--check")
    for name, size in (dims or {}).items():
        cmd += ["--dim", f"{name}={size}"]
    if tolerance:
        cmd += ["--atol", str(tolerance[0]), "--rtol", str(tolerance[1])]
    if model_type:
        cmd += ["--model-type", model_type]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ToolRun(tool, error=f"timeout after {timeout:.0f} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return ToolRun(tool, error=_key_line(proc.stderr) or f"exit code {proc.returncode}")
    data = json.loads(lines[-1])
    if not out.is_file():
        return ToolRun(tool, error="wrote no output file")
    return ToolRun(
        tool,
        seconds=data["seconds"],
        call_seconds=data["call_seconds"],
        peak_rss_mb=data["peak_rss_mb"],
        output=str(out),
        check=data.get("check"),
        check_reason=data.get("check_reason"),
        notes=data.get("notes", []),
    )


def _key_line(stderr: str) -> str:
    """The line of a traceback that says what went wrong (its last non-empty line)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=TOOLS + ORT_PEERS)
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--passes", default=None, help="graphopt only: the pass list (default pipeline if omitted)")
    parser.add_argument("--check", action="store_true", help="also run graphopt's numerics check of OUT against IN")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE", help="a dim for the check")
    parser.add_argument("--atol", type=float, default=None, help="element-wise check (with --rtol)")
    parser.add_argument("--rtol", type=float, default=None, help="element-wise check (with --atol)")
    parser.add_argument("--model-type", default="bert", help="ort_transformers only: the optimizer's model type")
    print(json.dumps(_child(parser.parse_args())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
