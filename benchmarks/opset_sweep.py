"""Sweep ``--target-opset`` over the ONNX node suite (and a folder of models): nothing unloadable
or wrong may be written.

    python benchmarks/opset_sweep.py --out /tmp/sweep.jsonl                  # node suite, opsets 17..25
    python benchmarks/opset_sweep.py --opsets 17,23 --match averagepool --out /tmp/s.jsonl
    python benchmarks/opset_sweep.py --models ~/.cache/ort-transformer-models --out /tmp/ort.jsonl
    python benchmarks/opset_sweep.py --summary /tmp/sweep.jsonl              # the table only

For each model onnxruntime runs, and each target opset, the pipeline runs in-process with
``target_opset`` (the numerics check off, as ``--no-check``); the model it writes is loaded
in onnxruntime and run on the node test's own inputs (a folder model: seeded inputs from
graphopt's check) and compared with the original's outputs in onnxruntime. Each run is one
JSON line: ``converted`` (outputs match), ``refused`` (exit 2, with the reason),
``unloadable``, ``run-error``, ``wrong``, ``crash`` (anything else). The output file is
appended to and runs already in it are skipped, so a killed sweep resumes.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt import io
from graphopt.api import optimize
from graphopt.errors import InputError

ort.set_default_logger_severity(4)
logging.disable(logging.WARNING)

OPSETS = list(range(17, 26))
OUTCOMES = ["converted", "refused", "unloadable", "run-error", "wrong", "crash"]


def _close(expected: Any, actual: Any, rtol: float, atol: float, values: bool = True) -> bool:
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(_close(e, a, rtol, atol, values) for e, a in zip(expected, actual))
        )
    if isinstance(expected, dict):
        return bool(expected == actual) or not values
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    if not values:
        return True
    if expected.dtype == object or expected.dtype.kind in "biuSU":
        return bool(expected.tolist() == actual.tolist())
    wide = np.float64
    return bool(np.allclose(actual.astype(wide), expected.astype(wide), rtol=rtol, atol=atol, equal_nan=True))


class Case:
    """One model to sweep: its file, its feeds, and the tolerance its outputs are compared at."""

    def __init__(
        self, name: str, proto: onnx.ModelProto, data: tuple[list[Any], list[Any]] | None, rtol: float, atol: float
    ):
        self.name, self.proto, self.data, self.rtol, self.atol = name, proto, data, rtol, atol


def node_cases(match: str) -> Iterator[Case]:
    from tests import node_suite

    for case in node_suite.cases():
        if match in case.name and case.data_sets:
            inputs, expected = case.data_sets[0]
            data = [node_suite._as_feed(v) for v in inputs], [node_suite._as_feed(v) for v in expected]
            yield Case(case.name, case.model, data, case.rtol * 10, max(case.atol * 10, 1e-6))


def folder_cases(folder: Path, match: str) -> Iterator[Case]:
    for path in sorted(folder.rglob("*.onnx")):
        name = str(path.relative_to(folder))
        if match in name:
            yield Case(name, onnx.load(str(path)), None, 1e-3, 1e-4)


def _feeds(case: Case, session: ort.InferenceSession, path: Path) -> Iterator[dict[str, Any]]:
    """The node test's inputs; for a folder model, graphopt's check inputs at each of its bindings."""
    if case.data is not None:
        yield dict(zip([i.name for i in session.get_inputs()], case.data[0]))
        return
    from graphopt.numerics.inputs import bind_dims, candidate_count, make_inputs, read_spec

    spec = read_spec(path)
    for k in range(candidate_count()):
        yield make_inputs(spec, bind_dims(spec, k, {}), np.random.default_rng(k))


def _original_outputs(case: Case, path: Path) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """Feeds the original runs on, its outputs, and its outputs on a second run."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    failure: Exception | None = None
    for feeds in _feeds(case, session, path):
        try:
            return feeds, session.run(None, feeds), session.run(None, feeds)
        except Exception as err:
            failure = failure or err
    assert failure is not None
    raise failure


def sweep_case(case: Case, opsets: list[int], workdir: Path, passes: str | None) -> Iterator[dict[str, Any]]:
    source = workdir / "in.onnx"
    onnx.save(case.proto, source)
    base = {"model": case.name, "own_opset": _opset(case.proto)}
    try:
        feeds, original, again = _original_outputs(case, source)
    except Exception as err:
        yield {**base, "opset": None, "outcome": "skipped", "why": f"original: {_line(err)}"}
        return
    deterministic = _close(original, again, 0, 0)
    for goal in opsets:
        start = time.perf_counter()
        outcome = _convert(source, goal, workdir, passes, feeds, original, deterministic, case)
        yield {**base, "opset": goal, **outcome, "seconds": round(time.perf_counter() - start, 3)}


def _convert(
    source: Path,
    goal: int,
    workdir: Path,
    passes: str | None,
    feeds: dict[str, Any],
    original: list[Any],
    deterministic: bool,
    case: Case,
) -> dict[str, Any]:
    target = workdir / "out.onnx"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = optimize(io.load(source), passes, target_opset=goal, check=False)
        io.save(result.model, target)
    except InputError as err:
        return {"outcome": "refused", "why": _line(err)}
    except Exception as err:
        return {"outcome": "crash", "why": f"{type(err).__name__}: {_line(err)}"}
    written = _opset(onnx.load(str(target), load_external_data=False))
    extra = {"written_opset": written}
    if result.report["failures"]:
        extra["failures"] = [f"{f['pass']}: {f['error'][:200]}" for f in result.report["failures"]]
    try:
        session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    except Exception as err:
        return {"outcome": "unloadable", "why": _line(err), **extra}
    try:
        outputs = session.run(None, feeds)
    except Exception as err:
        return {"outcome": "run-error", "why": _line(err), **extra}
    if _close(original, outputs, case.rtol, case.atol, values=deterministic):
        return {"outcome": "converted", **extra}
    if case.data is not None and _close(case.data[1], outputs, case.rtol, case.atol, values=deterministic):
        # onnxruntime's kernel at the new opset agrees with the suite where the old one did not
        return {"outcome": "converted", "note": "equals the suite's expected outputs, not the original's", **extra}
    return {"outcome": "wrong", "why": _difference(original, outputs), **extra}


def _difference(original: list[Any], outputs: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(original, outputs)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {a.dtype}{list(a.shape)} became {b.dtype}{list(b.shape)}"
        if a.dtype.kind in "fc":
            return f"output {i}: max abs error {float(np.nanmax(np.abs(a.astype(float) - b.astype(float)))):.3g}"
        if a.tolist() != b.tolist():
            return f"output {i}: values differ"
    return "outputs differ"


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return re.sub(r"/tmp/\S+", "<tmp>", text)[:300]


def summarize(rows: list[dict[str, Any]]) -> str:
    """The table per opset, then the refusals and the failures by reason."""
    swept = [r for r in rows if r["opset"] is not None]
    skipped = len({r["model"] for r in rows if r["opset"] is None})
    models = len({r["model"] for r in swept})
    lines = [f"{models} models swept, {skipped} skipped (onnxruntime cannot run the original)"]
    lines.append(f"{'opset':>5} " + " ".join(f"{o:>10}" for o in OUTCOMES))
    by_opset: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in swept:
        by_opset[r["opset"]][r["outcome"]] += 1
    for goal in sorted(by_opset):
        lines.append(f"{goal:>5} " + " ".join(f"{by_opset[goal][o]:>10}" for o in OUTCOMES))
    total: collections.Counter[str] = collections.Counter(r["outcome"] for r in swept)
    lines.append(f"{'all':>5} " + " ".join(f"{total[o]:>10}" for o in OUTCOMES))
    for outcome in OUTCOMES[1:]:
        reasons = collections.Counter(_reason(r["why"]) for r in swept if r["outcome"] == outcome)
        if reasons:
            lines.append(f"\n{outcome} by reason:")
            lines += [f"  {n:>5}  {why}" for why, n in reasons.most_common()]
    return "\n".join(lines)


def _reason(why: str) -> str:
    """A reason with the run-specific parts (names, numbers) blurred, to group by."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", why)
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="JSON lines, appended to (runs already there are skipped)")
    parser.add_argument("--opsets", default=",".join(map(str, OPSETS)))
    parser.add_argument("--match", default="", help="only models whose name contains this")
    parser.add_argument("--models", type=Path, help="sweep the .onnx files under this folder, not the node suite")
    parser.add_argument("--passes", default=None, help="the pipeline (default: graphopt's default pipeline)")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th model from the i-th")
    parser.add_argument("--summary", type=Path, help="print the table of a finished sweep file and exit")
    args = parser.parse_args(argv)
    if args.summary:
        print(summarize([json.loads(line) for line in args.summary.read_text().splitlines() if line.strip()]))
        return 0
    opsets = [int(v) for v in args.opsets.split(",")]
    done: set[tuple[str, int | None]] = set()
    if args.out and args.out.exists():
        done = {(r["model"], r["opset"]) for r in map(json.loads, args.out.read_text().splitlines()) if r}
    index, count = (int(v) for v in args.shard.split("/"))
    cases = folder_cases(args.models, args.match) if args.models else node_cases(args.match)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(cases):
            todo = [g for g in opsets if (case.name, g) not in done]
            if n % count != index or not todo or (case.name, None) in done:
                continue
            for row in sweep_case(case, todo, Path(tmp), args.passes):
                rows.append(row)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                if row["outcome"] not in ("converted", "skipped"):
                    print(f"{row['model']} @{row['opset']}: {row['outcome']}: {row.get('why', '')}", file=sys.stderr)
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
