"""Big models: does graphopt stay lazy where it must?

    python benchmarks/bigmodel.py                 # builds the models under ~/.cache/graphopt-big, then deletes them
    python benchmarks/bigmodel.py --big-mb 2200 --mid-mb 500 --keep

Three measurements, each tool run in its own process (seconds inside the call after imports,
peak RSS from VmHWM):

1. A generated transformer over 2 GB with external data, end to end through graphopt's
   default pipeline (load, every pass, save with external data; what `graphopt run big.onnx
   -o out/big.onnx --no-check` does), against onnx.load(load_external_data=True) +
   onnx.save_model(save_as_external_data=True) of the same file. Targets: peak RSS under
   1.5x the bytes of the tensors the passes touch (read, or created), time under 3x the
   onnx baseline. The tensors touched are counted by wrapping Tensor.numpy and
   Tensor.from_array while the pipeline runs.
2. resnet50.onnx load + save with no passes (graphopt.io) against onnx.load + onnx.save:
   the time ratio, target <= 1.5x.
3. Loading a ~500 MB model with external data (graphopt.io.load, touching no tensor):
   peak RSS against the bytes on disk, target < 1.3x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report
from tools import BUILDER, existing_default_pipeline, missing_passes, peak_rss_mb

RSS_TARGET = 1.5
TIME_TARGET = 3.0
CONVERT_TARGET = 1.5
LOAD_RSS_TARGET = 1.3


def _rss_now_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the children: one measurement each, after their imports --------------------------------


def child_onnx(src: Path, out: Path) -> dict[str, Any]:
    """onnx's own round trip; external data in, external data out when the input had it."""
    import onnx

    external = _has_external(src)
    imported = _rss_now_mb()
    start = time.perf_counter()
    model = onnx.load(str(src), load_external_data=True)
    if external:
        onnx.save_model(
            model, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location=f"{out.name}.data"
        )
    else:
        onnx.save_model(model, str(out))
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "import_rss_mb": imported}


def _has_external(path: Path) -> bool:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def child_graphopt_convert(src: Path, out: Path) -> dict[str, Any]:
    from graphopt.io import onnx_io, onnx_write

    imported = _rss_now_mb()
    start = time.perf_counter()
    onnx_write.save(onnx_io.load(src), out)
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "import_rss_mb": imported}


def child_graphopt_load(src: Path) -> dict[str, Any]:
    from graphopt.io import onnx_io

    imported = _rss_now_mb()
    start = time.perf_counter()
    model = onnx_io.load(src)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "import_rss_mb": imported, "nodes": len(model.graph)}


def child_graphopt_run(src: Path, out: Path, passes: str | None) -> dict[str, Any]:
    """optimize_file, as `graphopt run --no-check` calls it, counting the tensors the passes touch."""
    import graphopt.runner as runner
    from graphopt.ir.tensor import Tensor

    touched: dict[int, int] = {}
    reads_by_pass: dict[str, int] = {}
    active = [False]
    read, make = Tensor.numpy, Tensor.from_array.__func__  # type: ignore[attr-defined]

    def counting_read(self: Tensor) -> Any:
        if active[0]:
            touched[id(self)] = self.nbytes
            where = _pass_frame()
            reads_by_pass[where] = reads_by_pass.get(where, 0) + self.nbytes
        return read(self)

    def counting_make(cls: type[Tensor], array: Any, name: str = "") -> Tensor:
        tensor = make(cls, array, name)
        if active[0]:
            touched[id(tensor)] = tensor.nbytes
        return tensor

    optimize = runner.run_pipeline

    def counting_optimize(*args: Any, **kwargs: Any) -> Any:
        active[0] = True
        try:
            return optimize(*args, **kwargs)
        finally:
            active[0] = False

    Tensor.numpy = counting_read  # type: ignore[method-assign]
    Tensor.from_array = classmethod(counting_make)  # type: ignore[method-assign,assignment]
    runner.run_pipeline = counting_optimize  # type: ignore[assignment]
    pipeline = passes if passes is not None else existing_default_pipeline()
    imported = _rss_now_mb()
    start = time.perf_counter()
    result, _ = runner.optimize_file(src, runner.RunOptions.resolve(pipeline, output=out, check=False))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_rss_mb": peak_rss_mb(),
        "import_rss_mb": imported,
        "touched_mb": sum(touched.values()) / 2**20,
        "touched_tensors": len(touched),
        "read_mb_by_pass": {k: v / 2**20 for k, v in sorted(reads_by_pass.items(), key=lambda kv: -kv[1])},
        "phases": result["seconds"],
        "failures": result.get("failures", []),
        "missing_passes": missing_passes() if passes is None else [],
    }


def _pass_frame() -> str:
    """``module:function`` of the innermost pass code on the stack (every read, repeated reads too)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace(os.sep, "/")
        if "/graphopt/passes/" in path and not path.endswith(("/base.py", "/pipeline.py")):
            return f"{path.split('/graphopt/passes/', 1)[1]}:{frame.name}"
    return "outside the passes"


def _child_main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "onnx":
        data = child_onnx(Path(rest[0]), Path(rest[1]))
    elif kind == "convert":
        data = child_graphopt_convert(Path(rest[0]), Path(rest[1]))
    elif kind == "load":
        data = child_graphopt_load(Path(rest[0]))
    else:
        data = child_graphopt_run(Path(rest[0]), Path(rest[1]), rest[2] if len(rest) > 2 else None)
    print(json.dumps(data))
    return 0


def run_child(*args: str, timeout: float = 3600) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": tail[-1] if tail else f"exit code {proc.returncode}"}
    return dict(json.loads(lines[-1]))


# -- the parent -----------------------------------------------------------------------------


def disk_mb(path: Path) -> float:
    """The model file and its sidecar data file(s), in MB."""
    return sum(p.stat().st_size for p in path.parent.glob(f"{path.name}*")) / 2**20


def build(builder: Path, out: Path, megabytes: int) -> Path:
    subprocess.run(
        [sys.executable, str(builder), "--out", str(out), "--only", "wide_ensemble", "--big", str(megabytes)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out / f"big_transformer_{megabytes}mb.onnx"


def measure_big(src: Path, work: Path, passes: str | None) -> dict[str, Any]:
    (work / "onnx").mkdir(parents=True, exist_ok=True)
    baseline = run_child("onnx", str(src), str(work / "onnx" / src.name))
    shutil.rmtree(work / "onnx", ignore_errors=True)
    args = ["run", str(src), str(work / "graphopt" / src.name)] + ([passes] if passes else [])
    mine = run_child(*args)
    out_mb = disk_mb(work / "graphopt" / src.name) if (work / "graphopt" / src.name).is_file() else None
    shutil.rmtree(work / "graphopt", ignore_errors=True)
    result: dict[str, Any] = {"model": src.name, "disk_mb": disk_mb(src), "onnx": baseline, "graphopt": mine}
    result["output_mb"] = out_mb
    if "error" not in mine and "error" not in baseline:
        result["time_ratio"] = mine["seconds"] / baseline["seconds"]
        result["rss_per_touched"] = mine["peak_rss_mb"] / mine["touched_mb"] if mine["touched_mb"] else None
        result["rss_above_import_per_touched"] = (
            (mine["peak_rss_mb"] - mine["import_rss_mb"]) / mine["touched_mb"] if mine["touched_mb"] else None
        )
    return result


def measure_convert(src: Path, work: Path, repeats: int) -> dict[str, Any]:
    """Interleaved repeats of both round trips; the medians and their ratio."""
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"onnx": [], "graphopt": []}
    for _ in range(repeats):
        runs["onnx"].append(run_child("onnx", str(src), str(work / "onnx.onnx")))
        runs["graphopt"].append(run_child("convert", str(src), str(work / "graphopt.onnx")))
    shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"model": src.name, "disk_mb": disk_mb(src), "repeats": repeats}
    for key, items in runs.items():
        errors = [r["error"] for r in items if "error" in r]
        if errors:
            result[key] = {"error": errors[0]}
            continue
        result[key] = {
            "seconds": statistics.median(r["seconds"] for r in items),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in items),
        }
    if "seconds" in result["onnx"] and "seconds" in result["graphopt"]:
        result["time_ratio"] = result["graphopt"]["seconds"] / result["onnx"]["seconds"]
    return result


def measure_load(src: Path) -> dict[str, Any]:
    got = run_child("load", str(src))
    result: dict[str, Any] = {"model": src.name, "disk_mb": disk_mb(src), "graphopt": got}
    if "error" not in got:
        result["rss_ratio"] = got["peak_rss_mb"] / result["disk_mb"]
        result["rss_above_import_ratio"] = (got["peak_rss_mb"] - got["import_rss_mb"]) / result["disk_mb"]
    return result


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _verdict(value: float | None, limit: float) -> str:
    return "-" if value is None else ("yes" if value <= limit else "**no**")


def _big_md(big: dict[str, Any]) -> list[str]:
    g, o = big["graphopt"], big["onnx"]
    parts = [
        f"### {big['model']}: {big['disk_mb']:.0f} MB with external data, default pipeline end to end",
        "`graphopt.runner.optimize_file` with no check (what `graphopt run big.onnx -o out/big.onnx --no-check` does) "
        "against `onnx.load(load_external_data=True)` + `onnx.save_model(save_as_external_data=True)`. Tensors "
        "touched = bytes of the tensors the passes read (Tensor.numpy) or created (Tensor.from_array). Peak RSS "
        "includes the interpreter and its imports (import RSS shown apart).",
    ]
    if "error" in g or "error" in o:
        return [*parts, f"error: graphopt `{g.get('error', '-')}`, onnx `{o.get('error', '-')}`"]

    def ratio_row(label: str, ratio: float | None, limit: float) -> list[str]:
        return [label, _fmt(ratio), f"<= {limit}x", _verdict(ratio, limit)]

    def tool_row(label: str, run: dict[str, Any], touched: str) -> list[str]:
        return [
            label,
            _fmt(run["seconds"]),
            _fmt(run["peak_rss_mb"], ".0f"),
            _fmt(run["import_rss_mb"], ".0f"),
            touched,
        ]

    header = ["", "seconds", "peak RSS MB", "import RSS MB", "tensors touched MB"]
    rows = [tool_row("onnx load + save", o, "-"), tool_row("graphopt run", g, _fmt(g["touched_mb"], ".1f"))]
    targets = [
        ratio_row("time graphopt / onnx", big["time_ratio"], TIME_TARGET),
        ratio_row("peak RSS / touched", big["rss_per_touched"], RSS_TARGET),
        ratio_row("(peak - import RSS) / touched", big["rss_above_import_per_touched"], RSS_TARGET),
    ]
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in g["phases"].items())
    reads = ", ".join(f"{where} {mb:.0f} MB" for where, mb in g["read_mb_by_pass"].items()) or "none"
    parts += [
        report.md_table(header, rows),
        report.md_table(["", "ratio", "target", "met"], targets),
        f"graphopt phases: {phases}; output {_fmt(big['output_mb'], '.0f')} MB; "
        f"{g['touched_tensors']} tensors touched. Total minus the three phases is what optimize_file does besides "
        "(on 2026-11-22 mostly the report's sha256 of the input and output files, external data included). "
        f"Tensor bytes read, by the pass code that read them (repeated reads count again): {reads}.",
    ]
    if g["missing_passes"]:
        parts.append("Default pipeline without the passes not written yet: " + ", ".join(g["missing_passes"]))
    if g["failures"]:
        parts.append("Pass failures: " + "; ".join(f"{f['pass']}: `{f['error']}`" for f in g["failures"]))
    return parts


def _convert_md(conv: dict[str, Any]) -> list[str]:
    names = {"onnx": "onnx.load + onnx.save", "graphopt": "graphopt.io load + save"}
    rows = [
        [name, _fmt(conv[key].get("seconds")), _fmt(conv[key].get("peak_rss_mb"), ".0f"), conv[key].get("error", "")]
        for key, name in names.items()
    ]
    ratio = conv.get("time_ratio")
    return [
        f"### Load + save, no passes: {conv['model']} ({conv['disk_mb']:.0f} MB)",
        f"Median of {conv['repeats']} interleaved runs, each in its own process.",
        report.md_table(["", "seconds", "peak RSS MB", "error"], rows),
        f"Time graphopt / onnx: **{_fmt(ratio)}** (target <= {CONVERT_TARGET}x: {_verdict(ratio, CONVERT_TARGET)}).",
    ]


def _load_md(load: dict[str, Any]) -> list[str]:
    g = load["graphopt"]
    title = f"### Loading {load['model']} ({load['disk_mb']:.0f} MB on disk, external data), no tensor read"
    if "error" in g:
        return [title, f"error: `{g['error']}`"]
    header = ["seconds", "peak RSS MB", "import RSS MB", "peak RSS / disk", "(peak - import) / disk", "target", "met"]
    row = [_fmt(g["seconds"]), _fmt(g["peak_rss_mb"], ".0f"), _fmt(g["import_rss_mb"], ".0f")]
    row += [_fmt(load["rss_ratio"]), _fmt(load["rss_above_import_ratio"]), f"< {LOAD_RSS_TARGET}x"]
    row.append(_verdict(load["rss_ratio"], LOAD_RSS_TARGET))
    return [title, report.md_table(header, [row])]


def markdown(result: dict[str, Any]) -> str:
    parts = [
        "## Big models and load / save (`python benchmarks/bigmodel.py`)",
        report.describe_context(result["context"]),
    ]
    if "convert" in result:
        parts += _convert_md(result["convert"])
    if "load" in result:
        parts += _load_md(result["load"])
    if "big" in result:
        parts += _big_md(result["big"])
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "graphopt-big", help="where to build")
    ap.add_argument("--builder", type=Path, default=BUILDER)
    ap.add_argument("--corpus", type=Path, default=Path.home() / ".cache" / "graphopt-corpus")
    ap.add_argument("--big-mb", type=int, default=2200, help="size of the end-to-end model (0: skip)")
    ap.add_argument("--mid-mb", type=int, default=500, help="size of the load-only model (0: skip)")
    ap.add_argument("--repeats", type=int, default=3, help="round trips of resnet50 per tool (0: skip)")
    ap.add_argument("--passes", default=None, help="graphopt's pass list (default pipeline if omitted)")
    ap.add_argument("--keep", action="store_true", help="keep the generated models")
    ap.add_argument("--json-out", type=Path, default=report.ROOT / "bench-results" / "bigmodel.json")
    ap.add_argument("--markdown", type=Path, default=report.BENCHMARKS_MD)
    ap.add_argument("--no-markdown", action="store_true")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"disk: {shutil.disk_usage(args.dir).free / 2**30:.0f} GB free under {args.dir}", file=sys.stderr)
    result: dict[str, Any] = {"context": report.context()}
    work = args.dir / "work"
    if args.repeats:
        print("resnet50 load + save ...", file=sys.stderr)
        result["convert"] = measure_convert(args.corpus / "resnet50.onnx", work / "convert", args.repeats)
        print(json.dumps(result["convert"], indent=1), file=sys.stderr)
    if args.mid_mb:
        print(f"building the {args.mid_mb} MB model ...", file=sys.stderr)
        mid = build(args.builder, args.dir, args.mid_mb)
        result["load"] = measure_load(mid)
        print(json.dumps(result["load"], indent=1), file=sys.stderr)
        if not args.keep:
            _remove(mid)
    if args.big_mb:
        print(f"building the {args.big_mb} MB model ...", file=sys.stderr)
        big = build(args.builder, args.dir, args.big_mb)
        print("end to end ...", file=sys.stderr)
        result["big"] = measure_big(big, work / "big", args.passes)
        print(json.dumps(result["big"], indent=1), file=sys.stderr)
        if not args.keep:
            _remove(big)
    shutil.rmtree(work, ignore_errors=True)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    if not args.no_markdown:
        report.write_section("bench-bigmodel", markdown(result), args.markdown)
        print(f"updated: {args.markdown}", file=sys.stderr)
    return 0


def _remove(model: Path) -> None:
    for path in model.parent.glob(f"{model.name}*"):
        path.unlink()


if __name__ == "__main__":
    sys.exit(main())
