"""The bench harness still runs: wide_ensemble through graphopt alone, a few latency runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_runs_graphopt_on_wide_ensemble(corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nkept text\n\n<!-- bench-corpus:start -->\nold figures\n<!-- bench-corpus:end -->\n")
    cmd = [sys.executable, str(BENCHMARKS / "bench.py"), "--corpus", str(corpus_dir), "--models", "wide_ensemble"]
    cmd += ["--tools", "graphopt", "--quick", "--json-out", str(out), "--markdown", str(md)]
    cmd += ["--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    (entry,) = json.loads(out.read_text())["models"]
    assert entry["model"] == "wide_ensemble"
    assert entry["original"]["nodes"] == 69
    cell = entry["tools"]["graphopt"]
    assert cell["error"] is None, cell["error"]
    assert cell["check"] == "passed"
    assert 0 < cell["nodes"] <= 69
    assert cell["seconds"] > 0 and cell["peak_rss_mb"] > 0 and cell["bytes"] > 0
    for level in ("ORT_ENABLE_ALL", "ORT_DISABLE_ALL"):
        assert entry["latency"][level]["original"]["median_s"] > 0
        assert entry["latency"][level]["original"]["paired"] == 1.0
        assert entry["latency"][level]["graphopt"]["paired"] > 0
    # No peer ran, so there is nothing to compare with.
    assert entry["ratios"]["nodes"] is None

    text = md.read_text()
    assert "kept text" in text and "old figures" not in text
    assert text.count("<!-- bench-corpus:start -->") == 1
    assert "| wide_ensemble | 69 |" in text


def test_a_tool_that_fails_is_an_error_cell_not_a_crash(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from tools import run_tool
    finally:
        sys.path.remove(str(BENCHMARKS))
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")

    run = run_tool("graphopt", broken, tmp_path / "out" / "broken.onnx", timeout=120, check=False)

    assert run.error is not None and "broken.onnx" in run.error
    assert run.output is None


def test_opset_sweep_counts_a_refusal_and_a_conversion(tmp_path: Path) -> None:
    from tests.test_target_opset import REFUSED

    models, out = tmp_path / "models", tmp_path / "sweep.jsonl"
    models.mkdir()
    onnx.save(REFUSED["averagepool-dilations"][0], models / "pool.onnx")
    command = [sys.executable, str(BENCHMARKS / "opset_sweep.py"), "--models", models, "--opsets", "17,22"]
    done = subprocess.run([*map(str, command), "--out", str(out)], capture_output=True, text=True, check=True)
    rows = {row["opset"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert rows[17]["outcome"] == "refused" and "AveragePool" in rows[17]["why"]
    assert rows[22]["outcome"] == "converted"
    assert "refused by reason" in done.stdout


def test_bench_skips_the_exports_with_a_message_when_they_are_not_built(tmp_path: Path, monkeypatch, capsys) -> None:
    import argparse

    from rich.console import Console

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench

    monkeypatch.setattr(bench, "EXPORTS", tmp_path / "graphopt-exports")
    args = argparse.Namespace(runs=1, warmup=0, markdown=None, no_markdown=True)

    assert bench.bench_exports(args, Console(width=200)) == 0
    assert f"skipping the real exports: no index.json in {tmp_path / 'graphopt-exports'}" in capsys.readouterr().out

    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "export_fusions.py"), "--exports", str(tmp_path), "--no-markdown"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "build the exports first" in done.stdout


def test_export_fusions_renders_a_saved_run_and_names_what_misses_the_acceptance(tmp_path: Path) -> None:
    ratio = {"median_s": 0.002, "min_s": 0.002, "paired": 1.0, "paired_low": 1.0, "paired_high": 1.0}
    slower = {"median_s": 0.002, "min_s": 0.002, "paired": 1.1, "paired_low": 1.08, "paired_high": 1.12}
    row = {
        "model": "llama_ts",
        "name": "llama",
        "original": 1100,
        "graphopt_check": {"default": "passed", "opset23": "passed", "ort": "failed: new NaN"},
        "independent_check": {"default": "passed", "opset23": "passed", "ort": "passed"},
        "nodes": {"default": 287, "opset23": 132, "ort": 255},
        "ops": {
            "opset23": {"Attention": 4, "RMSNormalization": 9, "RotaryEmbedding": 6},
            "ort": {"MultiHeadAttention": 4},
        },
        "best_peer": "onnxslim",
        "best_peer_nodes": 391,
        "load_before": 0.5,
        "load_after": 0.7,
        "latency_all": {"original": ratio, "default": ratio, "ort": slower, "ort_extended": ratio},
        "latency_disable": {"original": ratio, "peer": ratio, "default": slower},
    }
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"context": _context(), "runs": 3, "warmup": 1, "models": [row]}))

    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "export_fusions.py"), "--render", str(saved), "--no-markdown"],
        capture_output=True,
        text=True,
        check=True,
    )

    assert "| llama_ts | 1100 | 287 | onnxslim 391 | -104 | passed | passed |" in done.stdout
    assert "| llama_ts | 4 | 132 | 4/4 | 9/9 | 0 | 0 | 6/8 | passed | passed |" in done.stdout
    (gaps,) = [line for line in done.stdout.splitlines() if line.startswith("- llama_ts: ")]
    assert "graphopt check at ort: failed: new NaN" in gaps
    assert "opset 23: RotaryEmbedding 6/8" in gaps
    assert "ort slower than the original" in gaps and "default slower than the original (ENABLE_ALL)" not in gaps
    assert "default slower than the original (DISABLE_ALL)" in gaps and "default slower than onnxslim" in gaps


def _context() -> dict[str, object]:
    machine = {"cores": 2, "cpu": "cpu", "memory_gb": 1, "system": "Linux", "python": "3.11"}
    return {"date": "2026-11-26", "machine": machine, "versions": {"graphopt": "0.1.0"}}
