"""The numerics check on the ONNX backend node test suite: how often, and why, "not checked".

    nice python benchmarks/node_suite_check.py --out /tmp/suite.jsonl      # run (about an hour)
    python benchmarks/node_suite_check.py --tally /tmp/suite.jsonl         # reasons by kind

Every case of onnx/backend/test/data/node goes through the default pipeline with the check
on (``graphopt.runner.optimize_file``, as ``graphopt run`` does), each in a process of its own
forked for it, one JSON line per case: its exit code, numerics status and reason, and the
peak RSS of that process and the check's child (``peak_rss_mb``, from wait4; it includes what
the forked process shares with this one, so it is an upper bound). The whole run is under an
address-space limit (``--memory-gb``) so that a check that ignores its own budget fails here
instead of exhausting the machine. Where the check gave up because the original failed at
every binding, the case's own inputs are run through onnxruntime too (``own_inputs``):
when they fail as well, the limit is onnxruntime's, not the inputs'. ``--tally`` sorts the
"not checked" reasons into kinds: the ones onnxruntime causes (it cannot load or run the
original), and the ones graphopt causes (inputs it could not make, inputs that make the
original fail, its budgets, crashes), and names the case with the highest peak RSS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (kind, pattern of the reason), first match wins. The first word says whose limit it is:
# onnxruntime's (it cannot load or run the original at all) or graphopt's (the check could
# have run it: inputs it could not make or made unfit, its budgets).
KINDS = (
    ("onnxruntime: cannot load the original (op, type or opset not implemented)", r"cannot load the original"),
    ("onnxruntime: crashes on the original", r"crashed with .* running the original"),
    ("graphopt: the memory budget", r"memory budget"),
    ("graphopt: out of memory (under this script's limit; the check had no budget)", r"MemoryError"),
    (
        "graphopt: an element type the check cannot feed or read (bfloat16, float8, int4, ...)",
        r"no generator for|Numpy type|can.t be converted to MLDataType|Creation of OrtValues",
    ),
    ("graphopt: sequence or optional inputs the check cannot make", r"type (seq|optional)\("),
    ("nondeterministic original (random ops)", r"nondeterministic"),
    ("graphopt: timed out", r"timed out"),
    ("onnxruntime: refuses an empty input", r"must not be empty"),
    (
        "graphopt: input values unfit for the op (indices, axes, shapes, counts, scales)",
        r"failed at.*(bounds|range|axis|axes|ind(ex|ice)|[Ss]cale|split|k argument|Depth|reshape|expand shape"
        r"|sequence.len|ratio|threshold|division by zero|Invalid|must|exceeds|extent|should|Inconsistent|size)",
    ),
    ("graphopt: the original fails on the generated inputs (other)", r"failed at"),
)


def kind_of(row: dict[str, Any]) -> str:
    reason = row["reason"] or ""
    if row.get("own_inputs", "").startswith("fail"):
        return "onnxruntime: fails on the original with the node test's own inputs too"
    kind = next((kind for kind, pattern in KINDS if re.search(pattern, reason)), None)
    if row["status"] == "error":
        return f"exit {row['exit_code']}, {kind or reason[:60]}"
    return kind or f"other: {reason[:80]}"


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError


def run(out: Path, memory_gb: float, seconds: int, only: str | None) -> None:
    import onnx

    import graphopt.runner  # noqa: F401  (imported once here: every forked case shares it)
    from tests import node_suite

    limit = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in node_suite.cases() if only is None or re.search(only, c.name)]
    with out.open("w", encoding="utf-8") as sink, tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(cases):
            source = Path(tmp) / f"{case.name}.onnx"
            onnx.save(case.model, source)
            started = time.perf_counter()
            line = Path(tmp) / "row.json"
            pid = os.fork()
            if pid == 0:  # the case's own process: its peak RSS is the case's
                code = 3
                try:
                    row = {"case": case.name} | _run_case(case, source, Path(tmp), seconds)
                    line.write_text(json.dumps(row), encoding="utf-8")
                    code = 0
                finally:
                    os._exit(code)
            _, status, usage = os.wait4(pid, 0)
            if line.exists():
                row = json.loads(line.read_text(encoding="utf-8"))
                line.unlink()
            else:
                reason = f"the case's process ended with wait status {status}"
                row = {"case": case.name, "exit_code": None, "status": "error", "reason": reason}
            row["seconds"] = round(time.perf_counter() - started, 3)
            row["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)  # kB on Linux
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            for leftover in Path(tmp).iterdir():
                if leftover.is_file():
                    leftover.unlink()
            print(f"{index + 1}/{len(cases)} {case.name}: {row['status']}", file=sys.stderr, flush=True)


def _run_case(case: Any, source: Path, tmp: Path, seconds: int) -> dict[str, Any]:
    from graphopt.errors import GraphoptError
    from graphopt.runner import RunOptions, optimize_file
    from tests import node_suite

    row: dict[str, Any] = {}
    signal.alarm(seconds)
    try:
        report, code = optimize_file(source, RunOptions(output=tmp / "out.onnx"))
        numerics = report["numerics"]
        row |= {"exit_code": code, "status": numerics["status"], "reason": numerics.get("reason")}
    except GraphoptError as err:
        row |= {"exit_code": err.exit_code, "status": "error", "reason": str(err)[:300]}
    except TimeoutError:
        row |= {"exit_code": None, "status": "error", "reason": f"over {seconds} s"}
    except Exception as err:
        row |= {"exit_code": 3, "status": "error", "reason": f"{type(err).__name__}: {err}"[:300]}
    finally:
        signal.alarm(0)
    if row["status"] == "not checked" and "failed at" in (row["reason"] or ""):
        try:
            loaded = node_suite.session(source)
            loaded.run(None, node_suite.feeds(case, loaded)[0])
            row["own_inputs"] = "run"
        except Exception as err:
            row["own_inputs"] = f"fail: {str(err).strip().splitlines()[0][:200] if str(err).strip() else err}"
    return row


def tally(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    statuses = collections.Counter(row["status"] for row in rows)
    print(f"{len(rows)} cases: " + ", ".join(f"{s} {n}" for s, n in statuses.most_common()))
    unchecked = [row for row in rows if row["status"] in ("not checked", "error")]
    print(f"not checked or error: {len(unchecked)} ({100 * len(unchecked) / max(1, len(rows)):.1f}%)")
    kinds = collections.Counter(kind_of(row) for row in unchecked)
    for kind, count in kinds.most_common():
        example = next(row["case"] for row in unchecked if kind_of(row) == kind)
        print(f"{count:6d}  {kind}  (e.g. {example})")
    measured = [row for row in rows if "peak_rss_mb" in row]
    if measured:
        top = max(measured, key=lambda row: row["peak_rss_mb"])
        print(f"peak RSS: at most {top['peak_rss_mb']} MB per case ({top['case']}), over {len(measured)} cases")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="Run the suite and write one JSON line per case here.")
    parser.add_argument("--tally", type=Path, help="Tally the reasons of an earlier run's lines.")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="Address-space limit of the whole run.")
    parser.add_argument("--seconds", type=int, default=300, help="Most seconds per case.")
    parser.add_argument("--only", help="Only the cases whose name matches this regular expression.")
    args = parser.parse_args()
    if args.out is not None:
        run(args.out, args.memory_gb, args.seconds, args.only)
    if args.tally is not None:
        tally(args.tally)


if __name__ == "__main__":
    main()
