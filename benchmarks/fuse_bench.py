"""Latency of the fuse rules' output: the original model against graphopt's default pipeline
(``--target onnx``) and ``--target ort``, interleaved, 1 thread, at ORT_ENABLE_ALL and
ORT_DISABLE_ALL (measure.py's paired ratios: each run divided by the original's run of the
same round, median kept).

    python benchmarks/fuse_bench.py --corpus /tmp/corpus --models bert_small,resnet50 --runs 40

Outputs are written with `graphopt run` (numerics checked) into --work-dir; the table goes
to stdout as markdown (BENCHMARKS.md keeps the measured one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import LEVELS, interleaved_latency, latency_dims, latency_feeds, node_count

VARIANTS = {"onnx": [], "ort": ["--target", "ort"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path.home() / ".cache" / "graphopt-corpus")
    parser.add_argument("--models", default="", help="comma list (default: every .onnx in the corpus)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/graphopt-fuse-bench"))
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    names = args.models.split(",") if args.models else sorted(p.stem for p in args.corpus.glob("*.onnx"))
    graphopt = Path(sys.executable).with_name("graphopt")
    columns = [f"{level.removeprefix('ORT_')} {variant}" for level in LEVELS for variant in VARIANTS]
    print("| model | nodes original / onnx / ort | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for name in names:
        original = args.corpus / f"{name}.onnx"
        paths = {"original": original}
        for variant, flags in VARIANTS.items():
            out = args.work_dir / variant / f"{name}.onnx"
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [str(graphopt), "run", str(original), "-o", str(out), *flags], check=True, capture_output=True
            )
            paths[variant] = out
        feeds = latency_feeds(original, latency_dims(original, {}))
        ratios = {}
        for level in LEVELS:
            found = interleaved_latency(paths, feeds, level, runs=args.runs, warmup=args.warmup)
            for variant in VARIANTS:
                stats = found[variant]
                ratios[level, variant] = f"{stats['paired']:.3f}" if isinstance(stats, dict) else stats
        counts = " / ".join(str(node_count(p).total) for p in paths.values())
        cells = [ratios[level, v] for level in LEVELS for v in VARIANTS]
        print(f"| {name} | {counts} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
