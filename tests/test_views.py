"""What people look at: `graphopt diff A B` (and `inspect A B`), and the run's console: the
pass table with chained counts and idle steps in one row, the final op histogram, the file
sizes, and what was not fused for the opset alone with the hint that fits the target."""

from __future__ import annotations

import html
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from rich.console import Console

from graphopt.report.console import render_report
from graphopt.report.views import not_fused
from tests.cli_helpers import diagnostics, invoke, mlp, one_line_error
from tests.passes.fuse.table import as_float16, exported_mlp
from tests.passes.fuse_models import erf_gelu, hardswish

EXPORTS = Path(__file__).parent / "fixtures" / "exports"


def _save(proto: onnx.ModelProto, path: Path) -> Path:
    onnx.save(proto, path)
    return path


# -- 1: graphopt diff A B ---------------------------------------------------------------------------


def test_diff_shows_signatures_ops_fused_sizes_and_opsets(tmp_path: Path) -> None:
    source = _save(erf_gelu(17), tmp_path / "gelu.onnx")
    optimized = tmp_path / "gelu.opt.onnx"
    assert invoke("run", source, "-o", optimized, "--target", "ort", "--no-check").exit_code == 0
    found = invoke("diff", source, optimized, "--json")
    assert found.exit_code == 0, found.stderr
    diff = json.loads(found.stdout)
    assert diff["a"] == str(source) and diff["b"] == str(optimized)
    assert diff["inputs"] == [{"name": "x", "a": "float[2, 5]", "b": "float[2, 5]"}]
    assert diff["nodes"] == [5, 1]
    ops = {row["op"]: (row["a"], row["b"], row["change"]) for row in diff["ops"]}
    assert ops["Erf"] == (1, 0, -1) and ops["Mul"] == (2, 0, -2)
    assert ops["com.microsoft::Gelu"] == (0, 1, 1)
    assert diff["fused"] == {"com.microsoft::Gelu": 1}
    assert diff["opsets"] == {"": [17, 17], "com.microsoft": [None, 1]}
    assert diff["file_bytes"] == [source.stat().st_size, optimized.stat().st_size]
    assert diff["parameters"][0] == 3 and diff["initializers"] == [3, 0]
    # inspect A B is the same comparison; on a terminal, a table per part
    assert json.loads(invoke("inspect", source, optimized, "--json").stdout) == diff
    shown = invoke("inspect", source, optimized).stdout
    assert f"{source} -> {optimized}" in shown
    assert re.search(r"│ com\.microsoft::Gelu\s+│\s+0 │\s+1 │\s+\+1 │", shown)
    assert "more in b: com.microsoft::Gelu +1" in shown
    assert "opsets: ai.onnx 17, com.microsoft (none) -> 1" in shown
    assert f"file {diff['file_bytes'][0]} B -> {diff['file_bytes'][1]} B" in shown and "initializers 3 -> 0" in shown


def test_diff_names_inputs_and_outputs_only_one_side_has(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a.onnx")
    b = mlp(tmp_path / "b.onnx", inputs="features")
    diff = json.loads(invoke("diff", a, b, "--json").stdout)
    assert diff["inputs"] == [
        {"name": "x", "a": "float[batch, 4]", "b": None},
        {"name": "features", "a": None, "b": "float[batch, 4]"},
    ]
    assert diff["fused"] == {}


def test_diff_reads_graphopt_json_graphs(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a.onnx")
    graph = tmp_path / "a.json"
    assert invoke("convert", a, graph).exit_code == 0
    diff = json.loads(invoke("diff", a, graph, "--json").stdout)
    assert diff["nodes"] == [2, 2] and all(row["change"] == 0 for row in diff["ops"])


def test_inspect_takes_one_or_two_models(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a.onnx")
    line = one_line_error(invoke("inspect", a, a, a))
    assert "inspect takes one model, or two to compare; got 3" in line
    assert "missing.onnx" in one_line_error(invoke("diff", a, tmp_path / "missing.onnx"))
    alone = json.loads(invoke("inspect", a, "--json").stdout)
    assert alone["file_bytes"] == a.stat().st_size


# -- 3: the run's console ---------------------------------------------------------------------------


def _rows(stderr: str) -> list[list[str]]:
    """The pass table's body rows, as cells."""
    rows = []
    for line in stderr.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if line.startswith("│") and len(cells) == 5:
            rows.append(cells)
    return rows


def _counts(cell: str) -> tuple[int, int]:
    before, _, after = cell.partition(" -> ")
    return int(before), int(after or before)


def test_the_run_ends_with_the_op_histogram_the_sizes_and_what_was_not_fused(tmp_path: Path) -> None:
    source = _save(erf_gelu(17), tmp_path / "gelu.onnx")
    result = invoke("run", source, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    lines = diagnostics(result)
    assert "not fused: GELU x1: need opset 20 (try --target-opset 20 or --target ort)" in lines
    assert any(re.fullmatch(r"file \d+ B -> \d+ B", line) for line in lines)
    assert any(line.startswith("unchanged: ") and "Erf 1" in line for line in lines)
    # what the hint says works
    fused = invoke("run", source, "-o", tmp_path / "out23.onnx", "--target-opset", "20")
    assert fused.exit_code == 0 and "not fused" not in fused.stderr
    assert re.search(r"│ Gelu\s+│\s+0 │\s+1 │\s+\+1 │", fused.stderr)
    ort = invoke("run", source, "-o", tmp_path / "ort.onnx", "--target", "ort")
    assert ort.exit_code == 0 and "not fused" not in ort.stderr


def _float16_weight() -> onnx.ModelProto:
    """x @ Cast(W): a 256 x 256 float16 weight, cast to float32 at every run unless the file grows by 128 kB."""
    weight = onnx.numpy_helper.from_array(np.full((256, 256), 0.5, np.float16), "W")
    nodes = [
        onnx.helper.make_node("Cast", ["W"], ["w32"], to=onnx.TensorProto.FLOAT),
        onnx.helper.make_node("MatMul", ["x", "w32"], ["y"]),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 256])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 256])],
        [weight],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_the_run_says_what_it_left_unfolded_for_size_and_the_options_that_fold_it(tmp_path: Path) -> None:
    source = _save(_float16_weight(), tmp_path / "fp16.onnx")
    result = invoke("run", source, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0, result.stderr
    line = next(line for line in diagnostics(result) if line.startswith("not folded for size"))
    assert line == (
        "not folded for size: 1 constant region would grow the file by up to 131.07 kB, past the growth limits "
        "(--const-cache-max-growth-bytes, 65.54 kB a region by default; --const-cache-max-model-growth, 10% of the "
        "model); --defer-growth folds them once per process instead"
    )
    summary = tmp_path / "summary.md"
    assert invoke("run", source, "-o", tmp_path / "again.onnx", "--markdown", summary).exit_code == 0
    assert f"**{line}**" in summary.read_text()
    # what the hint says works
    grown = tmp_path / "grown.onnx"
    folded = invoke(
        "run", source, "-o", grown, "--const-cache-max-growth-bytes", "131072", "--const-cache-max-model-growth", "1"
    )
    assert folded.exit_code == 0 and "not folded for size" not in folded.stderr
    assert "Cast" not in {n.op_type for n in onnx.load(grown).graph.node}


def test_the_run_names_the_rule_that_wrote_more_nodes_and_why(tmp_path: Path) -> None:
    """Latency beats node count: a float16 Gelu is written in float32 between two Casts (onnxruntime's CPU provider
    has no float16 Gelu kernel), so the output has two nodes more than the fused op alone; the console, the Markdown
    summary and the JSON report say which rule wrote them, why, and the option that leaves them out."""
    source = _save(as_float16(exported_mlp()), tmp_path / "mlp16.onnx")
    summary, page, report = tmp_path / "summary.md", tmp_path / "report.html", tmp_path / "report.json"
    views = ("--markdown", summary, "--html", page, "--report", report)
    result = invoke("run", source, "-o", tmp_path / "out.onnx", *views)
    assert result.exit_code == 0, result.stderr
    line = next(line for line in diagnostics(result) if line.startswith("more nodes"))
    assert line.startswith(
        "more nodes: gelu-float32 x1 wrote 2 more than it removed: Gelu on float16 -> Cast to float32, Gelu, Cast to "
        "float16: onnxruntime's CPU provider has no float16 Gelu kernel"
    )
    assert line.endswith("(--fuse-disable gelu-float32 leaves them out)")
    assert line in summary.read_text() and html.escape(line) in page.read_text()
    fuse_runs = [entry["details"] for entry in json.loads(report.read_text())["passes"] if entry["pass"] == "fuse"]
    assert [details["more_nodes"] for details in fuse_runs if "more_nodes" in details] == [{"gelu-float32": 2}]
    # what the line says works
    kept = invoke("run", source, "-o", tmp_path / "kept.onnx", "--fuse-disable", "gelu-float32")
    assert kept.exit_code == 0 and "more nodes" not in kept.stderr
    assert len(onnx.load(tmp_path / "kept.onnx").graph.node) == len(onnx.load(tmp_path / "out.onnx").graph.node) - 2


def test_the_hint_names_target_ort_only_where_onnxruntime_fuses_the_op(tmp_path: Path) -> None:
    source = _save(hardswish(13), tmp_path / "hardswish.onnx")
    for target in ("onnx", "ort"):  # onnxruntime has no HardSwish of its own: a newer opset either way
        result = invoke("run", source, "-o", tmp_path / f"{target}.onnx", "--target", target, "--no-check")
        assert result.exit_code == 0, result.stderr
        assert "not fused: HardSwish x1: need opset 14 (try --target-opset 14)" in diagnostics(result)


_ORT_OWN = "onnxruntime's own fusions did not match (their near misses are in the report)"


def _fuse_report(target: str, below_opset: dict[str, Any]) -> dict[str, Any]:
    details = {"target": target, "opset": [17, 17], "applied": {}, "near_misses": {}, "below_opset": below_opset}
    return {"passes": [{"pass": "fuse", "details": details}]}


def test_at_target_ort_the_ops_onnxruntime_fuses_get_no_opset_hint() -> None:
    blocked = {"Attention": {"opset": 23, "sites": 1}, "LayerNorm": {"opset": 17, "sites": 2}}
    lines = [group.line() for group in not_fused(_fuse_report("ort", {**blocked}))]
    assert lines == [
        "not fused: LayerNorm x2: need opset 17 (try --target-opset 17)",
        f"not fused: Attention x1: {_ORT_OWN}",
    ]
    (line,) = [group.line() for group in not_fused(_fuse_report("onnx", blocked))]
    hint = "(try --target-opset 23; --target ort fuses Attention)"
    assert line == f"not fused: LayerNorm x2, Attention x1: need opset 17 / 23 {hint}"


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_a_float16_export_given_target_ort_gets_no_target_opset_hint_for_its_attention(
    target: str, tmp_path: Path
) -> None:
    result = invoke(
        "run", EXPORTS / "llama_fp16_ts.onnx", "-o", tmp_path / "out.onnx", "--target", target, "--no-check"
    )
    assert result.exit_code == 0, result.stderr
    lines = [line for line in diagnostics(result) if line.startswith("not fused: ")]
    if target == "ort":
        assert lines == [f"not fused: Attention x1: {_ORT_OWN}"]  # its SiLU is QuickGelu in float16 too
    else:
        assert lines == [
            "not fused: RMSNorm x3, RotaryEmbedding x2, Attention x1, Swish x1: need opset 23 / 24"
            " (try --target-opset 24 or --target ort)"
        ]


def _run(label_group: str | None, number: int, nodes: tuple[int, int], name: str) -> dict[str, Any]:
    changed = nodes[0] != nodes[1]
    return {
        "pass": name,
        "group": label_group,
        "iteration": number,
        "seconds": 0.001,
        "changed": changed,
        "nodes": list(nodes),
        "initializers": [1, 1],
        "bytes": [4, 4],
        "op_delta": {"Identity": nodes[1] - nodes[0]} if changed else {},
        "details": {},
    }


def test_pass_rows_chain_and_idle_steps_share_one_row() -> None:
    # Two rounds of a group: its first pass changes in both, so the second pass's first
    # execution starts before the first pass's second one ended.
    runs = [
        _run("g", 0, (10, 8), "noop"),
        _run("g", 0, (8, 7), "dce"),
        _run("g", 1, (7, 6), "noop"),
        _run("g", 1, (6, 6), "dce"),
        _run(None, 0, (6, 6), "fold"),
        _run(None, 0, (6, 6), "unwind"),
    ]
    ops = {"before": {"Identity": 10}, "after": {"Identity": 6}}
    summary = {
        side: {"nodes": ops[side]["Identity"], "initializers": 1, "initializer_bytes": 4, "ops": ops[side]}
        for side in ops
    }
    report = {"input": {"path": "m.onnx"}, "passes": runs, "summary": summary, "numerics": {"status": "skipped"}}
    console = Console(record=True, width=200)
    render_report(console, report)
    rows = _rows(console.export_text())
    assert [row[0] for row in rows] == ["g/noop x2", "g/dce x2", "fold, unwind"]
    assert [row[1] for row in rows] == ["10 -> 7", "7 -> 6", "6"]
    assert "no change" in rows[2][4]


def test_a_real_export_chains_its_rows_to_the_summary(tmp_path: Path) -> None:
    result = invoke(
        "run", EXPORTS / "bert_ts.onnx", "-o", tmp_path / "out.onnx", "--no-check", "--report", tmp_path / "r.json"
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    rows = _rows(result.stderr)
    counts = [_counts(row[1]) for row in rows]
    assert counts[0][0] == report["summary"]["before"]["nodes"] and counts[-1][1] == report["summary"]["after"]["nodes"]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(counts))
    idle = [row for row in rows if row[4].startswith("no change")]
    assert len(idle) == 1 and idle[0][0] == "settle"
    assert (
        "not fused: Attention x2, GELU x2: need opset 23 / 20 (try --target-opset 23 or --target ort)" in result.stderr
    )
