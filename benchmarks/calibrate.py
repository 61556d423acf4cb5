"""Calibrate the fold pass's cost model from measured effects (issue 37, item 3).

    python benchmarks/calibrate.py measure --json-out bench-results/calibrate.json
    python benchmarks/calibrate.py fit bench-results/calibrate.json [more.json ...]

``measure``: for each model of the corpus and the exports, the default pipeline runs with the
fold pass taking no chain ("none"), which records the cost model's prediction for every chain
(fold.predict_chains); chains alike (the same ops and the same predicted terms, e.g. one Q/K/V
chain per layer) form one decision. Then per decision the pipeline runs again taking only
that decision's chains, and the outputs are timed against "none" as --tune times them
(tune.time_models: one child, interleaved shuffled rounds, 1 thread) at both levels, at the
sizes the cost model assumes first (batch 1, sequences of 64: measure.latency_dims). The measured
gain of a decision is (1 - with / none) x the time of "none", in microseconds; its noise is
the reach of the 95% bootstrap interval of the median of the per-round ratios
(measure.median_interval) plus the bias between two sessions of "none".

``fit``: the prediction error (sign agreement where the measured effect is beyond noise,
and the relative error), then a fit per level of the two scales of costs.CALIBRATION
(kernels saved, copies spent; see ``fit``), and the error and decisions after it. The
default takes a decision when its predicted gain is positive at both levels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure

import graphopt
import graphopt.passes.fold.fold as fold_pass
from graphopt.io.onnx_write import digest
from graphopt.passes.fold.costs import CALIBRATION, LEVELS
from graphopt.runtime.tune import paired_ratio, time_models

SOURCES = (Path("/work/corpus"), Path("/work/exports"))
LEVEL_NAMES = {"ORT_ENABLE_ALL": "all", "ORT_DISABLE_ALL": "disable"}
SCALES = np.geomspace(0.1, 10.0, 41)


def _key(predicted: fold_pass.ChainPrediction) -> str:
    """Chains alike: the same ops, member counts and predicted terms (rounded)."""
    ops = "+".join(f"{f.members[0].op_type}x{len(f.members)}" for f in predicted.chain)
    terms = ",".join(f"{predicted.terms[level][0]:.1f}/{predicted.terms[level][1]:.1f}" for level in LEVELS)
    return f"{ops}@{terms}"


def _names(predicted: fold_pass.ChainPrediction) -> frozenset[str]:
    return frozenset(m.outputs[0].name for f in predicted.chain for m in f.members)


@contextmanager
def taking(chosen: set[frozenset[str]], seen: dict[str, dict[str, Any]]) -> Iterator[None]:
    """The fold pass takes only the chains whose members are in ``chosen``; every chain it
    judges is recorded in ``seen`` by decision key."""
    judge = fold_pass._judge

    def select(index: Any, *, force: bool, tolerance: float) -> tuple[dict[int, dict[str, float]], list[Any]]:
        accepted: dict[int, dict[str, float]] = {}
        for priced in fold_pass.predict_chains(index):
            predicted = priced[0]  # at batch 1, the batch the decisions are timed at
            decision = seen.setdefault(
                _key(predicted),
                {"chains": [], "terms": predicted.terms, "gains": predicted.gains, "kernels": predicted.kernels},
            )
            names = _names(predicted)
            if names not in decision["chains"]:
                decision["chains"].append(names)
            if names in chosen:
                accepted.update({f.id: predicted.gains for f in predicted.chain})
        return accepted, []

    fold_pass._judge = select  # type: ignore[assignment]
    try:
        yield
    finally:
        fold_pass._judge = judge


def _write(source: Path, target: Path, chosen: set[frozenset[str]], seen: dict[str, dict[str, Any]]) -> str:
    with taking(chosen, seen):
        result = graphopt.optimize(source, check=False, runtime_guard=False)
    graphopt.save(result.model, target)
    return digest(result.model)


def measure_model(source: Path, seconds: float, folder: Path) -> dict[str, Any]:
    seen: dict[str, dict[str, Any]] = {}
    none = folder / "none.onnx"
    plain = _write(source, none, set(), seen)
    entry: dict[str, Any] = {"model": source.stem, "decisions": []}
    paths = [none, none]
    for index, (key, decision) in enumerate(seen.items()):
        target = folder / f"with-{index}.onnx"
        if _write(source, target, set(decision["chains"]), {}) == plain:
            continue  # the chains fold nothing a later pass keeps
        paths.append(target)
        entry["decisions"].append(
            {
                "key": key,
                "chains": len(decision["chains"]),
                "terms": decision["terms"],
                "predicted_us": decision["gains"],
                "kernels_us": decision["kernels"],
                "taken_by_default": all(decision["gains"][level] > 0 for level in LEVELS),
            }
        )
    if len(paths) == 2:
        return entry
    dims = measure.latency_dims(source, {})
    for level in LEVELS:
        times = time_models(paths, LEVEL_NAMES[level], 1, seconds, dims)
        if isinstance(times, str):
            entry[f"error_{level}"] = times
            continue
        # "none" ran in two sessions: each round's baseline is their mean, and how far one
        # session's median lies from the other's (a session's own bias on a busy machine: its
        # memory, its core) is added to every decision's noise.
        baseline = [(a + b) / 2 for a, b in zip(times[0], times[1], strict=True)]
        base_us = statistics.median(baseline) * 1e6
        bias = abs(paired_ratio(times[1], times[0])[0] - 1)
        entry.setdefault("none_us", {})[level] = base_us
        entry.setdefault("rounds", {})[level] = len(times[0])
        entry.setdefault("session_bias", {})[level] = bias
        for decision, timed in zip(entry["decisions"], times[2:], strict=True):
            # The noise of a decision: how far the 95% interval of its median ratio reaches, plus the bias.
            ratios = [w / n for w, n in zip(timed, baseline, strict=True)]
            ratio = statistics.median(ratios)
            low, high = measure.median_interval(ratios)
            decision.setdefault("measured_us", {})[level] = (1 - ratio) * base_us
            decision.setdefault("noise_us", {})[level] = (max(ratio - low, high - ratio) + bias) * base_us
    return entry


def command_measure(args: argparse.Namespace) -> None:
    models = [p for folder in SOURCES for p in sorted(folder.glob("*.onnx"))]
    if args.models:
        models = [p for p in models if p.stem in args.models.split(",")]
    results: list[dict[str, Any]] = []
    for source in models:
        with tempfile.TemporaryDirectory(prefix="graphopt-calibrate-") as folder:
            entry = measure_model(source, args.seconds, Path(folder))
        results.append(entry)
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=1))
        print(json.dumps({"model": entry["model"], "decisions": len(entry["decisions"])}), flush=True)


# -- fitting -------------------------------------------------------------------------------


def _rows(results: list[dict[str, Any]], level: str) -> list[dict[str, Any]]:
    """One row per decision at ``level``: its terms, the measured gain and its noise (None
    where it was not measured: then only its prediction's sign counts, which must not change)."""
    rows = []
    for entry in results:
        for decision in entry["decisions"]:
            saved, copies = decision["terms"][level]
            measured = decision.get("measured_us", {}).get(level)
            noise = decision.get("noise_us", {}).get(level)
            rows.append(
                {"model": entry["model"], "key": decision["key"], "saved": saved, "copies": copies}
                | {"measured": measured, "noise": noise}
            )
    return rows


def _predicted(row: dict[str, Any], scales: tuple[float, float]) -> float:
    return scales[0] * row["saved"] - scales[1] * row["copies"]


def _taken(row: dict[str, Any], scales: tuple[float, float]) -> bool:
    """As fold._judge takes a chain at one level: its predicted gain, to 0.01 us, above 0."""
    return round(_predicted(row, scales), 2) > 0


def _relative(row: dict[str, Any], scales: tuple[float, float]) -> float:
    return abs(_predicted(row, scales) - row["measured"]) / max(abs(row["measured"]), row["noise"])


def errors(rows: list[dict[str, Any]], scales: tuple[float, float]) -> dict[str, Any]:
    """Sign agreement where the measured effect is beyond noise; the relative error
    |predicted - measured| / max(|measured|, noise), median and mean over the measured."""
    measured = [r for r in rows if r["measured"] is not None]
    decisive = [r for r in measured if abs(r["measured"]) > r["noise"]]
    relative = [_relative(r, scales) for r in measured]
    return {
        "measured": len(measured),
        "beyond_noise": len(decisive),
        "sign_agrees": sum((_predicted(r, scales) > 0) == (r["measured"] > 0) for r in decisive),
        "median_relative_error": round(statistics.median(relative), 3) if relative else None,
        "mean_relative_error": round(statistics.fmean(relative), 3) if relative else None,
        "mean_relative_error_beyond_noise": (
            round(statistics.fmean(_relative(r, scales) for r in decisive), 3) if decisive else None
        ),
    }


def _allowed(rows: list[dict[str, Any]], before: tuple[float, float], scales: tuple[float, float]) -> bool:
    """No prediction changes sign unless its measurement says so beyond noise: no node count
    changes without a measured reason."""
    for row in rows:
        after = _taken(row, scales)
        changed = _taken(row, before) != after
        measured = row["measured"]
        justified = measured is not None and abs(measured) > row["noise"] and (measured > 0) == after
        if changed and not justified:
            return False
    return True


def fit(rows: list[dict[str, Any]], before: tuple[float, float]) -> tuple[float, float]:
    """The scales (kernels, copies), on a grid from 0.1 to 10, of the smallest mean relative
    error over the decisions measured beyond noise, among those _allowed: one scale for both
    terms, which keeps every decision of the model, unless two apart err less by a tenth.
    (Within noise any prediction near zero looks right: those decisions would only shrink the
    scales. Least squares is not used: one decision with an effect outside the model's form, a
    fold that costs onnxruntime a fusion, would set the scales alone.)"""
    decisive = [r for r in rows if r["measured"] is not None and abs(r["measured"]) > r["noise"]]
    if not decisive:
        return before

    def best(candidates: list[tuple[float, float]]) -> tuple[tuple[float, float], float]:
        found, found_error = before, errors(decisive, before)["mean_relative_error"]
        for scales in candidates:
            error = errors(decisive, scales)["mean_relative_error"]
            if error < found_error - 1e-6 and _allowed(rows, before, scales):
                found, found_error = scales, error
        return found, found_error

    grid = [round(float(x), 3) for x in SCALES]
    one, one_error = best([(x, x) for x in grid])
    two, two_error = best([(x, y) for x in grid for y in grid])
    return two if two_error < 0.9 * one_error else one


def _decisions(results: list[dict[str, Any]], scales: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """Per decision measured at both levels: taken under ``scales`` (gain > 0 at both levels),
    its verdict ("faster": beyond noise at both levels, "slower": beyond noise at one, else
    "within noise") and whether the take agrees with a verdict beyond noise (None within noise)."""
    found = []
    for entry in results:
        for decision in entry["decisions"]:
            if set(decision.get("measured_us", {})) != set(LEVELS):
                continue
            terms, measured, noise = decision["terms"], decision["measured_us"], decision["noise_us"]
            take = all(
                round(scales[level][0] * terms[level][0] - scales[level][1] * terms[level][1], 2) > 0
                for level in LEVELS
            )
            if all(measured[level] > noise[level] for level in LEVELS):
                verdict: str = "faster"
            elif any(measured[level] < -noise[level] for level in LEVELS):
                verdict = "slower"
            else:
                verdict = "within noise"
            right = None if verdict == "within noise" else take == (verdict == "faster")
            found.append(
                {"model": entry["model"], "key": decision["key"], "take": take, "verdict": verdict} | {"right": right}
            )
    return found


def pooled(files: list[Path]) -> list[dict[str, Any]]:
    """The results of several runs, one entry per model: a decision measured in several runs
    at a level takes the median of their gains, and counts as beyond noise only when every
    run found it so with the same sign (its noise is then the largest run's, else the
    largest |gain| of the runs, so that it stays within noise)."""
    by_model: dict[str, dict[str, Any]] = {}
    runs: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for file in files:
        for entry in json.loads(file.read_text()):
            by_model.setdefault(entry["model"], entry)
            for decision in entry["decisions"]:
                for level, gain in decision.get("measured_us", {}).items():
                    runs.setdefault((entry["model"], decision["key"], level), []).append(
                        (gain, decision["noise_us"][level])
                    )
    for entry in by_model.values():
        for decision in entry["decisions"]:
            for level in LEVELS:
                found = runs.get((entry["model"], decision["key"], level))
                if not found:
                    continue
                gains = [g for g, _ in found]
                agree = all(abs(g) > n for g, n in found) and len({g > 0 for g in gains}) == 1
                decision.setdefault("measured_us", {})[level] = statistics.median(gains)
                noise = max(n for _, n in found)
                decision.setdefault("noise_us", {})[level] = noise if agree else max(noise, *map(abs, gains))
                decision.setdefault("runs", {})[level] = len(found)
    return list(by_model.values())


def command_fit(args: argparse.Namespace) -> None:
    results = pooled(args.results)
    before = {level: CALIBRATION[level] for level in LEVELS}
    after = {}
    for level in LEVELS:
        rows = _rows(results, level)
        if not rows:
            print(level, "no measured decision")
            after[level] = before[level]
            continue
        after[level] = fit(rows, before[level])
        print(level, "before", before[level], errors(rows, before[level]))
        print(level, "after ", after[level], errors(rows, after[level]))
        for row in (r for r in rows if r["measured"] is not None):
            print(
                f"  {row['model']:24} {row['key'][:60]:60} measured {row['measured']:8.1f} +- {row['noise']:6.1f}"
                f"  predicted {_predicted(row, before[level]):8.1f} -> {_predicted(row, after[level]):8.1f}"
            )
    old, new = _decisions(results, before), _decisions(results, after)
    decisive = [d for d in new if d["right"] is not None]
    print(
        f"decisions measured at both levels: {len(new)}, beyond noise: {len(decisive)}, taken right: "
        f"{sum(bool(d['right']) for d in old)} -> {sum(bool(d['right']) for d in new)} of {len(decisive)}"
    )
    for was, now in zip(old, new, strict=True):
        if was["take"] != now["take"] or now["right"] is not None:
            print(f"  {now['model']} {now['key']}: measured {now['verdict']}, take {was['take']} -> {now['take']}")
    print("CALIBRATION =", json.dumps(after))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("measure")
    run.add_argument("--models", default="", help="comma list of model names (file stems)")
    run.add_argument("--seconds", type=float, default=15.0, help="seconds of interleaved timing per model and level")
    run.add_argument("--json-out", type=Path, default=Path("bench-results/calibrate.json"))
    fitting = sub.add_parser("fit")
    fitting.add_argument("results", type=Path, nargs="+", help="measure's results, pooled")
    args = ap.parse_args(argv)
    (command_measure if args.command == "measure" else command_fit)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
