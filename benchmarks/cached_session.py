"""Steady-state latency of CachedSession with --defer-growth (a benchmark, not a test).

    python benchmarks/cached_session.py                        # bert_fp16_weights, gpt2_small
    python benchmarks/cached_session.py --models bert_fp16_weights --runs 200

For each model, interleaved run by run (1 thread, batch 1, sequence 64), median over runs
of each one's time relative to the original's in the same round, at ORT_DISABLE_ALL and
ORT_ENABLE_ALL:

- original: the corpus model;
- graphopt: the default pipeline's output (the size guards keep weight Casts and the tied
  Transpose in the file, so they run on every call);
- graphopt --defer-growth via CachedSession: those size-growing folds run once, in
  runtime_fold, and each call feeds the cached results to the entry session;
- ort_basic: onnxruntime's basic-level offline output, which stores every fold in the file
  (float32 weights: the "fully folded" reference).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure

CORPUS = Path.home() / ".cache" / "graphopt-corpus"


def _graphopt(src: Path, out: Path, *extra: str) -> None:
    command = ["run", str(src), "-o", str(out), "-q", *extra]
    subprocess.run([sys.executable, "-c", "from graphopt.cli import main; main()", *command], check=True)


def _ort_basic(src: Path, out: Path) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(out)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def _runner(kind: str, path: Path, level: str) -> Callable[[dict[str, Any]], object]:
    import onnxruntime as ort

    from graphopt.runtime import CachedSession

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if kind == "cached":
        session: Any = CachedSession(path, options)
        names = session.input_names
    else:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
    return lambda feeds: session.run(None, {k: v for k, v in feeds.items() if k in names})


def measure_model(name: str, runs: int, warmup: int) -> dict[str, dict[str, float]]:
    src = CORPUS / f"{name}.onnx"
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {
            "original": ("plain", src),
            "graphopt": ("plain", work / "default" / f"{name}.onnx"),
            "graphopt --defer-growth (CachedSession)": ("cached", work / "deferred" / f"{name}.onnx"),
            "ort_basic": ("plain", work / "basic" / f"{name}.onnx"),
        }
        _graphopt(src, models["graphopt"][1])
        _graphopt(src, models["graphopt --defer-growth (CachedSession)"][1], "--defer-growth")
        models["ort_basic"][1].parent.mkdir(parents=True)
        _ort_basic(src, models["ort_basic"][1])
        feeds = measure.latency_feeds(src, measure.latency_dims(src, {}))
        for level in ("ORT_DISABLE_ALL", "ORT_ENABLE_ALL"):
            runners = {key: _runner(kind, path, level) for key, (kind, path) in models.items()}
            samples: dict[str, list[float]] = {key: [] for key in runners}
            order = list(runners)
            for round_index in range(warmup + runs):
                shift = round_index % len(order)
                for key in order[shift:] + order[:shift]:
                    start = time.perf_counter()
                    runners[key](feeds)
                    if round_index >= warmup:
                        samples[key].append(time.perf_counter() - start)
            reference = samples["original"]
            for key, values in samples.items():
                paired = statistics.median(v / r for v, r in zip(values, reference, strict=True))
                results.setdefault(key, {})[level] = paired
            results["original"][level + " ms"] = statistics.median(reference) * 1e3
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert_fp16_weights,gpt2_small")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    for name in args.models.split(","):
        results = measure_model(name, args.runs, args.warmup)
        base = results["original"]
        print(
            f"{name}: original {base['ORT_DISABLE_ALL ms']:.2f} ms at ORT_DISABLE_ALL, "
            f"{base['ORT_ENABLE_ALL ms']:.2f} ms at ORT_ENABLE_ALL"
        )
        print(f"  {'output':42s} {'DISABLE_ALL':>12s} {'ENABLE_ALL':>12s}")
        for key, stats in results.items():
            print(f"  {key:42s} {stats['ORT_DISABLE_ALL']:12.3f} {stats['ORT_ENABLE_ALL']:12.3f}")


if __name__ == "__main__":
    main()
