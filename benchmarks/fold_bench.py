"""The fold pass on the corpus: onnxruntime latency with and without it, at both levels.

    python benchmarks/fold_bench.py                       # every corpus model
    python benchmarks/fold_bench.py --models bert_small --runs 500 --json-out fold.json

For each model two outputs are written: the default pipeline without ``fold`` ("unfolded")
and the default pipeline ("folded"); both are timed interleaved run by run (1 thread,
batch 1, sequence 64), at ORT_ENABLE_ALL and ORT_DISABLE_ALL. The figure of merit is
folded / unfolded: the median over rounds of the folded run's time divided by the unfolded
run's time of the same round, with a 95% bootstrap interval of that median. Where the pass
folds nothing the two files are the same model and the interval shows the noise floor.
``--all-folds`` makes the pass take every fold its cost model would refuse (to see what the
cost model saves). The ppocr models come with the corpus builder's ``--real``; a model
missing from the corpus folder is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure

import graphopt
from graphopt.passes.pipeline import DEFAULT_PIPELINE, pipeline_from_config

DEFAULT_CORPUS = Path.home() / ".cache" / "graphopt-corpus"
MODELS = [
    "wide_ensemble",
    "tf_style_nhwc",
    "bert_small",
    "bert_fp16_weights",
    "gpt2_small",
    "inception_v1",
    "resnet50",
    "ppocr_v4_det",
    "ppocr_v4_rec",
    "ppocr_mobile_cls",
]


def _without_fold(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept = []
    for step in steps:
        if step.get("pass") == "fold":
            continue
        if "steps" in step:
            step = {**step, "steps": _without_fold(step["steps"])}
        kept.append(step)
    return kept


def _write(source: Path, target: Path, steps: list[dict[str, Any]]) -> dict[str, Any]:
    result = graphopt.optimize(source, pipeline_from_config(steps), check=False)
    graphopt.save(result.model, target)
    folds = [p["details"] for p in result.report["passes"] if p["pass"] == "fold"]
    return {
        "folds": sum(len(d.get("folds", [])) for d in folds),
        "refused": sum(len(d.get("refused", [])) for d in folds),
    }


def timing_parser(description: str | None, runs: int) -> argparse.ArgumentParser:
    """The options every fold benchmark has: the corpus folder, timed and warm-up rounds."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--warmup", type=int, default=30)
    return parser


def main() -> None:
    parser = timing_parser(__doc__, runs=300)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--all-folds", action="store_true", help="take every fold, paying or not")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.all_folds:
        import graphopt.passes.fold.fold as fold_pass

        fold_pass.gains_us = lambda terms: {level: 1.0 for level in fold_pass.LEVELS}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            source = args.corpus / f"{name}.onnx"
            if not source.is_file():
                print(name, f"missing: {source} (build.py --out {args.corpus} --real builds the ppocr models)")
                continue
            unfolded, folded = Path(tmp) / f"{name}.unfolded.onnx", Path(tmp) / f"{name}.folded.onnx"
            _write(source, unfolded, _without_fold(DEFAULT_PIPELINE))
            counts = _write(source, folded, DEFAULT_PIPELINE)
            feeds = measure.latency_feeds(source, measure.latency_dims(source, {}))
            row: dict[str, Any] = {**counts}
            for level in measure.LEVELS:
                timed = measure.interleaved_latency(
                    {"unfolded": unfolded, "folded": folded}, feeds, level, runs=args.runs, warmup=args.warmup
                )
                plain, done = timed["unfolded"], timed["folded"]
                if isinstance(plain, dict) and isinstance(done, dict):
                    row[level] = {
                        "unfolded_us": round(plain["median_s"] * 1e6, 1),
                        "folded_us": round(done["median_s"] * 1e6, 1),
                        "ratio": round(done["paired"], 4),
                        "interval": [round(done["paired_low"], 4), round(done["paired_high"], 4)],
                    }
                else:
                    row[level] = {"error": str(done if isinstance(plain, dict) else plain)}
            results[name] = row
            print(name, json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
