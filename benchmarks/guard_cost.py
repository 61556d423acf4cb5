"""What the runtime guard costs the default run (issue 37: under 25% of the run's time per export).

    python benchmarks/guard_cost.py --json-out /tmp/guard-cost.json            # every export
    python benchmarks/guard_cost.py --models resnet18_ts,/work/corpus/resnet50.onnx --rounds 5
    python benchmarks/guard_cost.py --source /tmp/old-checkout --json-out old.json   # another commit's code

Per model, ``graphopt run MODEL -o OUT --report R.json`` (the default pipeline and check) runs
with the guard and with ``--no-runtime-guard``, in ``--rounds`` rounds, the order of the two
alternating from round to round. Each figure is the median over the rounds of the report's
``seconds.total`` (the run after the load: pipeline, guard, save, check); the guard's share
is (with - without) / with, beside the report's own ``seconds.runtime_guard``. The load
average is recorded per model (the machine may be shared). With ``--keep DIR`` the guarded
output of the last round stays in DIR (to compare outputs across commits with ``cmp``) and
the guard's verdict and censuses are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EXPORTS = Path("/work/exports")
GRAPHOPT_MAIN = "import sys; from graphopt.cli import main; sys.argv[0] = 'graphopt'; main()"


def models(spec: str | None) -> list[Path]:
    """The exports of index.json, or the names (exports) and paths given, comma-separated."""
    if spec is None:
        return [EXPORTS / entry["file"] for entry in json.loads((EXPORTS / "index.json").read_text())["models"]]
    return [Path(name) if "/" in name else EXPORTS / f"{name}.onnx" for name in spec.split(",")]


def run_once(model: Path, guard: bool, scratch: Path, source: Path | None) -> dict[str, Any]:
    """One default run; its report's seconds and guard record."""
    output, report = scratch / model.name, scratch / "report.json"
    scratch.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", GRAPHOPT_MAIN, "run", str(model), "-o", str(output), "--report", str(report)]
    command += [] if guard else ["--no-runtime-guard"]
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source)
    # Run from the scratch folder: python -c puts the working folder first on the path.
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=scratch.parent, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{model.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    found = json.loads(report.read_text())
    return {"seconds": found["seconds"], "runtime_guard": found.get("runtime_guard"), "output": output}


def measure(model: Path, rounds: int, source: Path | None, keep: Path | None) -> dict[str, Any]:
    with_guard: list[dict[str, Any]] = []
    without: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="guard-cost-") as folder:
        scratch = Path(folder)
        for index in range(rounds):
            for guard in (True, False) if index % 2 == 0 else (False, True):
                (with_guard if guard else without).append(run_once(model, guard, scratch / str(guard), source))
                if guard and keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    for file in (scratch / "True").iterdir():
                        if file.name != "report.json":
                            shutil.copyfile(file, keep / file.name)
    total_with = statistics.median(r["seconds"]["total"] for r in with_guard)
    total_without = statistics.median(r["seconds"]["total"] for r in without)
    guard = with_guard[-1]["runtime_guard"] or {}
    return {
        "model": str(model),
        "total_with": total_with,
        "total_without": total_without,
        "share": (total_with - total_without) / total_with,
        "runtime_guard_seconds": statistics.median(r["seconds"].get("runtime_guard", 0.0) for r in with_guard),
        "reported_share": statistics.median(
            r["seconds"].get("runtime_guard", 0.0) / r["seconds"]["total"] for r in with_guard
        ),
        "status": guard.get("status"),
        "reruns": guard.get("reruns"),
        "census": guard.get("census"),
        "undone": [{k: v for k, v in u.items() if k != "message"} for u in guard.get("undone", [])],
        "lost": [{k: v for k, v in u.items() if k != "message"} for u in guard.get("lost", [])],
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated export names or model paths (default: every export)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--source", type=Path, help="a checkout whose graphopt package runs (default: this one)")
    parser.add_argument("--keep", type=Path, help="a folder for the guarded outputs of the last round")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'model':<28} {'with':>7} {'without':>7} {'share':>6} {'guard s':>7} {'rep.':>5} {'reruns':>6} load")
    for model in models(args.models):
        row = measure(model, args.rounds, args.source, args.keep)
        rows.append(row)
        print(
            f"{model.stem:<28} {row['total_with']:7.2f} {row['total_without']:7.2f} {row['share']:6.0%} "
            f"{row['runtime_guard_seconds']:7.2f} {row['reported_share']:5.0%} {row['reruns']!s:>6} {row['load']:.2f}",
            flush=True,
        )
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
