"""The result cache (``--cache DIR``, ``GRAPHOPT_CACHE``): an unchanged model costs a digest
and a copy; anything that decides the result (the model, its weights, the options) misses;
a damaged entry is a miss, never a wrong model; the cache stays within its limit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import graphopt.runner
from graphopt.files import STAGING_PREFIX, _host_tag
from graphopt.schemas import schema
from tests.cli_helpers import invoke, mlp
from tests.reliability.builders import with_external_data


def _run(source: Path, output: Path, cache: Path, *extra: str | Path) -> dict[str, Any]:
    result = invoke("run", source, "-o", output, "--cache", cache, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _counting_runs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The models the pipeline really ran on (a hit runs none)."""
    ran: list[Path] = []
    optimize = graphopt.runner._optimize_file

    def counted(source: Path, *args: Any, **kwargs: Any) -> Any:
        ran.append(source)
        return optimize(source, *args, **kwargs)

    monkeypatch.setattr(graphopt.runner, "_optimize_file", counted)
    return ran


def test_an_unchanged_model_comes_from_the_cache_with_the_same_bytes_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = _counting_runs(monkeypatch)
    source = mlp(tmp_path / "m.onnx", 2.0)
    first = _run(source, tmp_path / "a" / "m.onnx", tmp_path / "cache")
    written = (tmp_path / "a" / "m.onnx").read_bytes()
    second = _run(source, tmp_path / "a" / "m.onnx", tmp_path / "cache")
    assert ran == [source]
    assert first["cache"]["status"] == "stored" and second["cache"]["status"] == "hit"
    assert second["cache"]["key"] == first["cache"]["key"]
    assert (tmp_path / "a" / "m.onnx").read_bytes() == written
    assert second["output"] == first["output"] and second["input"] == first["input"]
    assert second["numerics"] == first["numerics"] and second["numerics"]["status"] == "passed"
    assert second["summary"] == first["summary"]
    jsonschema.validate(second, schema("report"))


def test_the_console_says_a_result_came_from_the_cache(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx")
    _run(source, tmp_path / "out.onnx", tmp_path / "cache")
    result = invoke("run", source, "-o", tmp_path / "out.onnx", "--cache", tmp_path / "cache")
    assert result.exit_code == 0
    assert f"wrote {tmp_path / 'out.onnx'} from the cache" in result.stderr


@pytest.mark.parametrize(
    "change",
    ["model", "options", "output name", "check options"],
)
def test_anything_that_decides_the_result_misses(tmp_path: Path, change: str) -> None:
    source = mlp(tmp_path / "m.onnx", 2.0)
    first = _run(source, tmp_path / "out.onnx", tmp_path / "cache")
    output, extra = tmp_path / "out.onnx", []
    if change == "model":
        mlp(source, 3.0)
    elif change == "options":
        extra = ["--passes", "shape-infer,cleanup"]
    elif change == "output name":
        output = tmp_path / "other.onnx"
    else:
        extra = ["--atol", "1e-3", "--rtol", "1e-3"]
    second = _run(source, output, tmp_path / "cache", *extra)
    assert second["cache"]["status"] == "stored"
    assert second["cache"]["key"] != first["cache"]["key"]


def test_changed_external_data_misses(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    source = with_external_data(tmp_path / "in")
    first = _run(source, tmp_path / "out" / "m.onnx", tmp_path / "cache")
    weights = next(p for p in source.parent.iterdir() if p != source)
    data = bytearray(weights.read_bytes())
    data[0] ^= 1
    weights.write_bytes(bytes(data))
    second = _run(source, tmp_path / "out" / "m.onnx", tmp_path / "cache")
    assert second["cache"]["status"] == "stored" and second["cache"]["key"] != first["cache"]["key"]


def test_external_data_is_restored_beside_the_model(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    source = with_external_data(tmp_path / "in")
    _run(source, tmp_path / "a" / "m.onnx", tmp_path / "cache", "--external-data")
    report = _run(source, tmp_path / "b" / "m.onnx", tmp_path / "cache", "--external-data")
    assert report["cache"]["status"] == "hit"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in (tmp_path / "a").iterdir())
    assert Path(report["output"]["external_data"]["path"]).parent == tmp_path / "b"
    check = invoke("check", source, tmp_path / "b" / "m.onnx")
    assert check.exit_code == 0, check.stderr


def test_a_damaged_entry_is_a_miss_and_is_replaced(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx")
    first = _run(source, tmp_path / "out.onnx", tmp_path / "cache")
    stored = tmp_path / "cache" / first["cache"]["key"] / "out.onnx"
    stored.write_bytes(stored.read_bytes()[:-10])  # a disk error, a half-copied cache
    second = _run(source, tmp_path / "out.onnx", tmp_path / "cache")
    assert second["cache"]["status"] == "stored"
    assert invoke("check", source, tmp_path / "out.onnx").exit_code == 0
    assert _run(source, tmp_path / "out.onnx", tmp_path / "cache")["cache"]["status"] == "hit"


def test_a_run_whose_check_failed_is_not_stored(tmp_path: Path) -> None:
    source = mlp(tmp_path / "m.onnx")
    for _ in range(2):  # the second run fails again: nothing came from the cache
        broken = ("--passes", "test-breaks-numerics", "--cache", tmp_path / "cache")
        result = invoke("run", source, "-o", tmp_path / "out.onnx", *broken)
        assert result.exit_code == 1 and "numerics failed" in result.stderr
    assert not any((tmp_path / "cache").glob("*/entry.json"))
    assert not (tmp_path / "out.onnx").exists()


def test_the_cache_keeps_within_its_limit_dropping_the_least_recently_used(tmp_path: Path) -> None:
    sources = [mlp(tmp_path / f"m{i}.onnx", float(i + 1)) for i in range(3)]
    cache = tmp_path / "cache"
    first = _run(sources[0], tmp_path / "out0.onnx", cache)
    entry = sum(f.stat().st_size for f in (cache / first["cache"]["key"]).iterdir())
    limit = f"{2.5 * entry / 1e6:.6f}"  # room for two entries
    _run(sources[1], tmp_path / "out1.onnx", cache, "--cache-limit", limit)
    assert _run(sources[0], tmp_path / "out0.onnx", cache, "--cache-limit", limit)["cache"]["status"] == "hit"
    _run(sources[2], tmp_path / "out2.onnx", cache, "--cache-limit", limit)  # m1 was used least recently
    assert len(list(cache.glob("*/entry.json"))) == 2
    assert _run(sources[0], tmp_path / "out0.onnx", cache, "--cache-limit", limit)["cache"]["status"] == "hit"
    assert _run(sources[1], tmp_path / "out1.onnx", cache, "--cache-limit", limit)["cache"]["status"] == "stored"


def test_a_folder_run_counts_the_models_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp(tmp_path / "models" / "a.onnx", 1.0)
    mlp(tmp_path / "models" / "b.onnx", 2.0)
    monkeypatch.setenv("GRAPHOPT_CACHE", str(tmp_path / "cache"))
    first = invoke("run", tmp_path / "models", "-o", tmp_path / "out/", "--json")
    assert first.exit_code == 0 and json.loads(first.stdout)["totals"]["cached"] == 0
    mlp(tmp_path / "models" / "b.onnx", 5.0)
    second = invoke("run", tmp_path / "models", "-o", tmp_path / "out/", "--json")
    assert second.exit_code == 0, second.stderr
    assert json.loads(second.stdout)["totals"]["cached"] == 1
    assert "2 models, 0 failures, 0 not checked, 1 from the cache" in second.stderr
    assert "a.onnx: ok, nodes" in second.stderr and "(from the cache)" in second.stderr


def test_a_cache_path_that_is_a_file_is_bad_usage(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a folder")
    result = invoke("run", mlp(tmp_path / "m.onnx"), "-o", tmp_path / "out.onnx", "--cache", tmp_path / "cache")
    assert result.exit_code == 2
    assert "graphopt: error: --cache" in result.stderr and "not a folder" in result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_concurrent_runs_storing_one_result_both_succeed(tmp_path: Path) -> None:
    for folder in ("a", "b"):  # the same model twice, run by two workers at once: the same key
        mlp(tmp_path / "models" / folder / "m.onnx", 2.0)
    runs = [invoke("run", tmp_path / "models", "-o", tmp_path / "out/", "-j", "2", "--json", "--cache", tmp_path / "c")]
    runs.append(invoke("run", tmp_path / "models", "-o", tmp_path / "out/", "--json", "--cache", tmp_path / "c"))
    assert [run.exit_code for run in runs] == [0, 0], runs[0].stderr
    assert len(list((tmp_path / "c").glob("*/entry.json"))) == 1
    assert json.loads(runs[1].stdout)["totals"]["cached"] == 2
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_what_a_killed_run_left_in_the_cache_goes(tmp_path: Path) -> None:
    left = tmp_path / "cache" / f"{STAGING_PREFIX}{_host_tag()}-{2**22 + 1}-killed"  # no such pid: a dead run
    left.mkdir(parents=True)
    (left / "out.onnx").write_bytes(b"half a model")
    _run(mlp(tmp_path / "m.onnx"), tmp_path / "out.onnx", tmp_path / "cache")
    assert not left.exists()
