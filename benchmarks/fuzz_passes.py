"""Fuzz the passes with mutated models: every failure of a pass on a model graphopt loads is a bug.

    python benchmarks/fuzz_passes.py                         # node suite + corpus + random graphs
    python benchmarks/fuzz_passes.py --sources suite --mutants 4 --out /tmp/fuzz
    python benchmarks/fuzz_passes.py --shard 0/2 & python benchmarks/fuzz_passes.py --shard 1/2

Valid models (the ONNX backend node test suite, the corpus, random graphs from
tests/reliability/random_graphs.py) are mutated by tests/reliability/mutate.py. A mutant
graphopt refuses (bad input) is skipped; on every other one, each pass, the default pipeline
and ``shape-infer,unwind`` run through ``graphopt.api.optimize`` with the IR verified after
each pass. The failures the report lists (which the pipeline rolled back) are grouped by
pass, exception type and the innermost graphopt frame; the first mutant of each group is
saved under ``--out`` with a line describing it, so it can become a regression test.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.api import optimize
from graphopt.errors import InputError
from graphopt.io import load
from graphopt.ir import Model
from graphopt.ir.clone import clone_model
from tests.reliability.mutate import mutants

PIPELINES = ["shape-infer", "noop", "dce", "cse", "strip-value-info", "unwind", "shape-infer,unwind", None]
CORPUS = Path.home() / ".cache" / "graphopt-corpus"
_FRAME = re.compile(r'File ".*?/(graphopt/[^"]+)", line (\d+), in (\w+)')


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Timeout


@dataclass
class Finding:
    pipeline: str
    error: str
    where: str
    count: int = 0
    examples: list[str] = field(default_factory=list)


def suite_models() -> Iterator[tuple[str, onnx.ModelProto]]:
    from tests.node_suite import cases

    for case in cases():
        if getattr(case, "model", None) is not None:
            yield f"suite/{case.name}", case.model


def corpus_models() -> Iterator[tuple[str, onnx.ModelProto]]:
    for path in sorted(CORPUS.glob("*.onnx")):
        yield f"corpus/{path.stem}", onnx.load(path, load_external_data=False)


def random_models(count: int) -> Iterator[tuple[str, onnx.ModelProto]]:
    from hypothesis.errors import NonInteractiveExampleWarning

    from tests.reliability.random_graphs import random_models as strategy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        for index in range(count):
            yield f"random/{index}", strategy().example()


def _where(trace: str) -> str:
    frames = _FRAME.findall(trace)
    inner = [f for f in frames if not f[0].startswith(("graphopt/passes/pipeline.py", "graphopt/api.py"))]
    path, line, function = (inner or frames or [("?", "0", "?")])[-1]
    return f"{path}:{line} ({function})"


def run_mutant(model: Model, label: str, findings: dict[tuple[str, str, str], Finding], out: Path | None,
               proto: onnx.ModelProto, timeout: int) -> int:  # fmt: skip
    failures = 0
    for pipeline in PIPELINES:
        name = pipeline or "default"
        copy = clone_model(model)
        signal.alarm(timeout)
        try:
            result = optimize(copy, pipeline, verify=True, check=False)
            runs = [(f.name, f.error or f.failures[0].error, f.traceback or "") for f in result.pipeline_run.failures]
        except Timeout:
            runs = [(name, "Timeout: no answer in time", "")]
        except Exception as err:  # the pipeline itself must never raise
            runs = [(name, f"pipeline raised {type(err).__name__}: {err}", traceback.format_exc())]
        finally:
            signal.alarm(0)
        for pass_name, error, trace in runs:
            kind = error.split(":", 1)[0]
            key = (pass_name, kind, _where(trace))
            finding = findings.get(key)
            if finding is None:
                finding = findings[key] = Finding(pass_name, kind, key[2])
                print(f"NEW {pass_name} [{name}] {error[:160]} at {key[2]}\n    {label}", flush=True)
                if out is not None:
                    stem = f"{len(findings):03d}_{pass_name}_{kind}"
                    onnx.save(proto, out / f"{stem}.onnx")
                    (out / f"{stem}.txt").write_text(f"{label}\n{pipeline}\n{error}\n{trace}\n")
            finding.count += 1
            if len(finding.examples) < 3:
                finding.examples.append(label)
            failures += 1
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default="suite,corpus,random", help="comma list of suite, corpus, random")
    parser.add_argument("--mutants", type=int, default=6, help="mutants per suite or random model")
    parser.add_argument("--corpus-mutants", type=int, default=3, help="mutants per corpus model")
    parser.add_argument("--random", type=int, default=200, help="how many random graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", default="0/1", help="i/n: fuzz every n-th model starting at i")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per pipeline on one mutant")
    parser.add_argument("--mutations", help="comma list of mutation kinds (default: all of mutate.MUTATIONS)")
    parser.add_argument("--out", type=Path, help="folder for one mutant per distinct failure")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    shard, shards = (int(p) for p in args.shard.split("/"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    sources = set(args.sources.split(","))
    models: list[Iterator[tuple[str, onnx.ModelProto]]] = []
    if "suite" in sources:
        models.append(suite_models())
    if "corpus" in sources:
        models.append(corpus_models())
    if "random" in sources:
        models.append(random_models(args.random))
    kinds = args.mutations.split(",") if args.mutations else None
    findings: dict[tuple[str, str, str], Finding] = {}
    loaded = refused = failures = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # With --out the mutant under test stays there: a crash (onnx's C++ code) leaves it behind.
        path = (args.out or Path(tmp)) / "current.onnx"
        index = -1
        for source in models:
            for base, proto in source:
                index += 1
                if index % shards != shard:
                    continue
                count = args.corpus_mutants if base.startswith("corpus/") else args.mutants
                for number, (what, mutant) in enumerate(mutants(proto, args.seed * 100_003 + index, count, kinds)):
                    path.write_bytes(mutant.SerializeToString())
                    path.with_suffix(".txt").write_text(f"{base}#{number}: {what}\n")
                    try:
                        model = load(path, opaque_ops="quiet")
                    except InputError:
                        refused += 1
                        continue
                    except Exception as err:  # the loader must refuse bad input, never crash
                        model = None
                        key = ("load", type(err).__name__, _where(traceback.format_exc()))
                        if key not in findings:
                            print(f"NEW load {type(err).__name__}: {err}\n    {base}#{number}: {what}", flush=True)
                        findings.setdefault(key, Finding(*key)).count += 1
                    if model is None:
                        continue
                    loaded += 1
                    failures += run_mutant(model, f"{base}#{number}: {what}", findings, args.out, mutant, args.timeout)
    seconds = time.perf_counter() - start
    print(f"\n{loaded} mutants loaded, {refused} refused, {failures} pass failures, {seconds:.0f} s")
    for finding in sorted(findings.values(), key=lambda f: -f.count):
        print(f"{finding.count:6d}  {finding.pipeline:18s} {finding.error:22s} {finding.where}")
        for example in finding.examples:
            print(f"        {example}")


if __name__ == "__main__":
    main()
