"""The report as a page and as a CI job summary: `graphopt run --html/--markdown` and
`graphopt report show`, read as text and, for the HTML, rendered by a real headless Chromium
and compared loosely with the screenshots committed in tests/fixtures/pages/ (the page is not
blank, its charts are where they were)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphopt.report.html import render_html
from graphopt.report.markdown import SUMMARY_LIMIT, render_markdown
from tests.cli_helpers import error_lines, invoke, mlp, one_line_error
from tests.png import read_png

EXPORTS = Path(__file__).parent / "fixtures" / "exports"
REFERENCES = Path(__file__).parent / "fixtures" / "pages"
FOLDER_MODELS = ("poolformer_ts", "levit_ts", "mobilevit_ts")


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    """Run in ``folder``: the paths on the pages are relative, the same on every machine."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checked run of a TorchScript BERT with its report, page and summary."""
    out = tmp_path_factory.mktemp("single")
    shutil.copy(EXPORTS / "bert_ts.onnx", out / "bert_ts.onnx")
    with _inside(out):
        result = invoke(
            "run", "bert_ts.onnx", "-o", "bert.opt.onnx", "--report", "report.json",
            "--html", "report.html", "--markdown", "report.md",
        )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of three exports run as two shards of a CI matrix, and the merged report."""
    out = tmp_path_factory.mktemp("folder")
    (out / "models").mkdir()
    for name in FOLDER_MODELS:
        shutil.copy(EXPORTS / f"{name}.onnx", out / "models" / f"{name}.onnx")
    with _inside(out):
        for shard in (1, 2):
            result = invoke("run", "models", "-o", "optimized/", "--shard", f"{shard}/2", "--report", f"s{shard}.json")
            assert result.exit_code == 0, result.stderr
        merged = invoke("report", "merge", "s1.json", "s2.json", "-o", "all.json")
        assert merged.exit_code == 0, merged.stderr
        shown = invoke("report", "show", "all.json", "--html", "all.html", "--markdown", "all.md")
        assert shown.exit_code == 0, shown.stderr
    return out


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


# -- the HTML as text -------------------------------------------------------------------------------


def test_a_model_page_has_every_section_and_fetches_nothing(single: Path) -> None:
    page = (single / "report.html").read_text()
    for section in (
        "Pipeline: nodes per step",
        "Ops before / after",
        "Fused",
        "Not fused: near misses by family",
        "Numerics",
        "binding 1: batch=3, sequence=16",
        "binding 2: batch=1, sequence=128",
        "not fused: Attention x2, GELU x2: need opset 23 / 20 (try --target-opset 23 or --target ort)",
        "unsqueeze-unsqueeze",
        'aria-label="nodes per step"',
        'aria-label="ops before and after"',
        "bert_ts.onnx",
    ):
        assert section in page, section
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "src=" not in page and "@import" not in page and "url(" not in page
    assert page.count("<script>") == 1  # the few lines that sort a table, inline
    # the run's page is the same as `report show`'s of its report (timings and all)
    assert render_html(_load(single / "report.json")) == page


def test_a_folder_page_has_the_models_table_sortable_with_totals(folder: Path) -> None:
    page = (folder / "all.html").read_text()
    merged = _load(folder / "all.json")
    assert "3 models (shards 1/2, 2/2)" in page and "3 models, 0 failures, 0 not checked" in page
    assert page.count("<th data-sort>") == 6 and "click a column to sort" in page
    for name in FOLDER_MODELS:
        assert page.count(f"/{name}.onnx</") >= 2  # its row in the table, and its folded page
    nodes = merged["totals"]["nodes"]
    assert f"nodes {nodes[0]} -&gt; {nodes[1]}" in page
    assert 'aria-label="nodes before and after"' in page
    assert "http://" not in page and "https://" not in page


def test_a_check_optimized_report_gets_its_page_too(tmp_path: Path) -> None:
    model = mlp(tmp_path / "models" / "m.onnx")
    result = invoke(
        "run", model.parent, "--check-optimized", "--html", tmp_path / "gate.html", "--markdown", tmp_path / "gate.md"
    )
    assert result.exit_code == 1
    assert "not optimized" in (tmp_path / "gate.html").read_text()
    assert f"| `{model}` | ❌ not optimized |" in (tmp_path / "gate.md").read_text()


def test_a_failed_check_writes_its_views_as_it_writes_its_report(tmp_path: Path) -> None:
    model = mlp(tmp_path / "m.onnx")
    result = invoke(
        "run", model, "--passes", "test-breaks-numerics", "-o", tmp_path / "out.onnx", "--report", tmp_path / "r.json",
        "--html", tmp_path / "r.html", "--markdown", tmp_path / "r.md",
    )  # fmt: skip
    assert result.exit_code == 1
    assert not (tmp_path / "out.onnx").exists()
    assert '<span class="bad">failed</span>' in (tmp_path / "r.html").read_text()
    assert "### Numerics: ❌ failed" in (tmp_path / "r.md").read_text()


def test_view_targets_are_checked_before_any_work(tmp_path: Path) -> None:
    model = mlp(tmp_path / "m.onnx")
    notes = tmp_path / "notes.html"
    notes.write_text("mine")
    line = one_line_error(invoke("run", model, "-o", tmp_path / "out.onnx", "--html", notes))
    assert "notes.html: exists and was not written by --html; --html will not replace it" in line
    assert notes.read_text() == "mine" and not (tmp_path / "out.onnx").exists()
    line = one_line_error(invoke("run", model, "-o", tmp_path / "out.onnx", "--markdown", model))
    assert "--markdown names a model of this run" in line
    line = one_line_error(invoke("run", model, "-o", tmp_path / "out.onnx", "--markdown", "-", "--json"))
    assert "--markdown and --json would both print on stdout" in line
    # a page graphopt wrote is replaced
    assert invoke("run", model, "-o", tmp_path / "out.onnx", "--html", tmp_path / "r.html").exit_code == 0
    assert invoke("run", model, "-o", tmp_path / "out.onnx", "--html", tmp_path / "r.html").exit_code == 0


def test_report_show_refuses_what_is_not_a_report(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    assert "other.json: not a graphopt report" in one_line_error(
        invoke("report", "show", other, "--html", tmp_path / "x.html")
    )
    assert not (tmp_path / "x.html").exists()


# -- the Markdown ---------------------------------------------------------------------------------


def test_a_model_summary_has_every_section(single: Path) -> None:
    text = (single / "report.md").read_text()
    for section in (
        "## `",
        "### Pipeline",
        "| settle | 103 |",
        "### Ops before → after",
        "| `Constant` | 107 | 0 | -107 |",
        "### Fused",
        "### Not fused",
        "**not fused: Attention x2, GELU x2: need opset 23 / 20 (try --target-opset 23 or --target ort)**",
        "<details><summary>near misses by family</summary>",
        "### Numerics: ✅ passed",
        "binding 1 (batch=3, sequence=16;",
    ):
        assert section in text, section
    assert len(text.encode()) < 16 * 1024


def test_a_folder_summary_fits_a_job_summary_and_says_what_it_left_out(folder: Path) -> None:
    report = _load(folder / "all.json")
    text = (folder / "all.md").read_text()
    assert "## graphopt: 3 models (shards 1/2, 2/2)" in text
    for row in report["models"]:
        assert f"| `{row['input']['path']}` |" in text
        assert f"<details><summary><code>{row['input']['path']}</code></summary>" in text
    assert len(text.encode()) <= SUMMARY_LIMIT and "left out" not in text
    full = len(text.encode())
    cut = render_markdown(report, limit=full - 100)
    assert len(cut.encode()) <= full - 100
    assert "> 1 of 3 models' details left out: a job summary takes 1 MiB at most" in cut
    assert cut.count("<details><summary><code>") == 2 and cut.count("| ✅ ok |") == 3  # the table stays whole


def test_markdown_to_stdout_appends_to_a_job_summary(folder: Path) -> None:
    result = invoke("report", "show", folder / "all.json", "--markdown", "-")
    assert result.exit_code == 0 and result.stdout == (folder / "all.md").read_text()
    assert not error_lines(result)


# -- the HTML in a real browser -------------------------------------------------------------------

_BLUE = (9, 105, 218)  # the "after" bars
_GREY = (175, 184, 193)  # the "before" bars
_WINDOW = {"single": "1100,2000", "folder": "1100,900"}


def _chromium(*arguments: str) -> str:
    """Run headless Chromium; its stdout."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium): the page is not rendered")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", *arguments]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout


def _screenshot(page: Path, kind: str, out: Path) -> np.ndarray:
    shot = out / f"{kind}.png"
    _chromium(
        "--hide-scrollbars", "--force-device-scale-factor=0.5", f"--window-size={_WINDOW[kind]}",
        f"--screenshot={shot}", page.resolve().as_uri(),
    )  # fmt: skip
    if os.environ.get("GRAPHOPT_UPDATE_PAGES"):  # refresh the references after a change of the page
        REFERENCES.mkdir(exist_ok=True)
        shutil.copy(shot, REFERENCES / shot.name)
    return read_png(shot)[..., :3]


def _near(image: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    return np.all(np.abs(image.astype(np.int64) - colour) < 24, axis=-1)


def _ink_profile(image: np.ndarray, bands: int = 20) -> np.ndarray:
    """The share of pixels that are not background, in horizontal bands from the top."""
    ink = np.any(image < 235, axis=-1).mean(axis=1)
    return np.array([band.mean() for band in np.array_split(ink, bands)])


def _blocks(rows: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive True rows: (first, last)."""
    found: list[tuple[int, int]] = []
    for y in np.flatnonzero(rows):
        if found and y == found[-1][1] + 1:
            found[-1] = (found[-1][0], int(y))
        else:
            found.append((int(y), int(y)))
    return found


def _like_the_reference(image: np.ndarray, kind: str) -> None:
    reference = read_png(REFERENCES / f"{kind}.png")[..., :3]
    assert image.shape == reference.shape
    ink = np.any(image < 235, axis=-1).mean()
    assert 0.02 < ink < 0.6, f"the page looks blank or garbled ({ink:.1%} ink)"
    profile, expected = _ink_profile(image), _ink_profile(reference)
    assert np.corrcoef(profile, expected)[0, 1] > 0.8, (profile, expected)
    for colour in (_BLUE, _GREY):
        found, wanted = _near(image, colour).sum(), _near(reference, colour).sum()
        assert 0.6 * wanted <= found <= 1.5 * wanted, (colour, found, wanted)


@pytest.mark.slow
def test_the_model_page_renders_with_its_charts(single: Path, tmp_path: Path) -> None:
    image = _screenshot(single / "report.html", "single", tmp_path)
    blue_rows = _near(image, _BLUE).any(axis=1)
    blocks = _blocks(blue_rows)
    pipeline = blocks[0]  # the bars of nodes per step, the tallest first: one block
    assert pipeline[0] < image.shape[0] * 0.15 and pipeline[1] - pipeline[0] >= 30, blocks
    ops = [b for b in blocks[1:] if b[1] - b[0] <= 6]  # one short after-bar per op type, under the legend
    assert len(ops) >= 15, blocks
    _like_the_reference(image, "single")


@pytest.mark.slow
def test_the_folder_page_renders_with_its_table_and_chart(folder: Path, tmp_path: Path) -> None:
    image = _screenshot(folder / "all.html", "folder", tmp_path)
    bars = [b for b in _blocks(_near(image, _BLUE).any(axis=1)) if b[1] - b[0] <= 6]
    assert len(bars) >= len(FOLDER_MODELS), bars  # a pair of bars per model
    header = _near(image, (246, 248, 250)).any(axis=1)  # the models table's head
    assert header[: image.shape[0] // 2].any()
    _like_the_reference(image, "folder")


@pytest.mark.slow
def test_a_click_on_a_column_sorts_the_models(folder: Path, tmp_path: Path) -> None:
    clicked = tmp_path / "clicked.html"
    script = '<script>document.querySelectorAll("th[data-sort]")[1].click();</script></body>'  # the nodes column
    clicked.write_text((folder / "all.html").read_text().replace("</body>", script))
    rows = re.findall(r'<tr><td>([^<]*)</td><td class="n" data-v="(\d+)"', _chromium("--dump-dom", clicked.as_uri()))
    nodes = [int(after) for _, after in rows]
    assert len(rows) == len(FOLDER_MODELS) and nodes == sorted(nodes, reverse=True), rows
    report = _load(folder / "all.json")
    assert nodes != [row["summary"]["after"]["nodes"] for row in report["models"]]  # the order did change
