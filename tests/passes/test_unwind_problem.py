"""The layout problem and its solvers: the brief's worked cases, random problems against an
exhaustive search, and the JSON form."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from graphopt.layout import Problem, ProblemError, problem_from_json, solve
from tests.cli_helpers import invoke
from tests.passes.unwind_reference import evaluate, exhaustive

SOLVERS = ("greedy", "default")


def check_solutions(problem: Problem) -> dict[str, float]:
    """Solve with both solvers; each reported objective must equal an independent evaluation
    of the solution's layouts, and the default must not score below greedy."""
    scores = {}
    for name in SOLVERS:
        solution = solve(problem, name).as_dict()
        assert solution["objective"] == pytest.approx(evaluate(problem, solution["layouts"]))
        assert solution["upper_bound"] == pytest.approx(problem.upper_bound)
        scores[name] = solution["objective"]
    assert scores["default"] >= scores["greedy"] - 1e-9
    return scores


# -- the worked cases of the brief ---------------------------------------------------------


def evaluation_case() -> Problem:
    p = Problem()
    p.sink((5,), "A")
    p.source((5,), "B")
    p.sink((3,), "C")
    p.source((3,), "D")
    p.sink((3,), "E")
    for a, b, v in [("A", "B", 5), ("C", "D", 2), ("C", "E", 7), ("D", "E", 11)]:
        p.pair(a, b, v)
    return p


def test_evaluation_of_given_layouts_is_80_and_the_optimum_85() -> None:
    p = evaluation_case()
    given = {
        "A": [
            {"at": 0, "count": 4, "source": "B", "index": 0, "step": 1},
            {"at": 4, "count": 1, "source": "A", "index": 4, "step": 1},
        ],
        "C": [{"at": 0, "count": 3, "source": "D", "index": 0, "step": 1}],
        "E": [{"at": 0, "count": 3, "source": "D", "index": 0, "step": 1}],
    }
    assert evaluate(p, given) == 80
    labels = np.arange(p.slot_count)
    labels[p.ref["A"][:4]] = p.ref["B"][:4]
    labels[p.ref["C"]] = p.ref["D"]
    labels[p.ref["E"]] = p.ref["D"]
    assert p.objective(labels) == 80
    scores = check_solutions(p)
    assert scores["default"] == 85
    assert p.upper_bound == 85


def test_matmul_unwinds_sources_to_sinks_for_2000() -> None:
    p = Problem()
    p.sink((20, 10), "X")
    p.sink((8, 10), "Y")
    p.sink((12, 10), "Z")
    lhs = p.dim_shuffle("X", [1, 0], "lhs")
    rhs = p.concat(["Y", p.reverse("Z", [0])], 0, "rhs")
    p.fixed_point([lhs, rhs], [(10, 10)], ["out"])
    p.source((10, 20), "Slhs")
    p.source((20, 10), "Srhs")
    p.pair(lhs, "Slhs", 5)
    p.pair(rhs, "Srhs", 5)
    assert check_solutions(p) == {"greedy": 2000, "default": 2000}
    layouts = solve(p).as_dict()["layouts"]
    # X is Slhs unwound through the DimShuffle: X[i, j] = Slhs[j, i].
    assert layouts["X"][0] == {"at": 0, "count": 10, "source": "Slhs", "index": 0, "step": 20}
    assert layouts["Y"] == [{"at": 0, "count": 80, "source": "Srhs", "index": 0, "step": 1}]
    # Z is Srhs[8:20] reversed along axis 0: its first row is Srhs's last.
    assert layouts["Z"][0] == {"at": 0, "count": 10, "source": "Srhs", "index": 190, "step": 1}


def test_broadcast_add_scores_205_5() -> None:
    p = Problem()
    p.sink((4, 6), "W")
    p.source((4, 6), "Sw")
    p.pair("W", "Sw", 8.5)
    p.source((5, 4), "Xs")
    (act,) = p.fixed_point(["Xs", "W"], [(5, 6)], ["act"])
    p.sink((6,), "bias")
    p.sum_like([act, "bias"], 0, "out")
    r = p.sum_like_reduce(act, (6,), "r")
    p.pair("bias", r, 0.25)
    assert check_solutions(p)["default"] == 205.5


def call_case() -> Problem:
    p = Problem()
    p.sink((2, 4), "a")
    p.sink((6,), "b")
    at = p.dim_shuffle("a", [1, 0], "at")
    br = p.reshape("b", (2, 3), "br")
    p.fixed_point([at, br], [(4, 3)], ["out"])
    p.source((4, 2), "Slhs")
    p.source((2, 3), "Srhs")
    p.pair(at, "Slhs", 8)
    p.pair(br, "Srhs", 8)
    for name, shape in [("A", (2, 4)), ("B", (6,)), ("C", (2, 4)), ("D", (6,))]:
        p.sink(shape, name)
    (e,) = p.call(["A", "B"], ["a", "b"], ["out"], 2, ["E"])
    (f,) = p.call(["C", "D"], ["a", "b"], ["out"], 2, ["F"])
    p.sum_like([e, f], 0, "sumOut")
    p.pair(e, f, 2)
    return p


def test_call_copies_satisfy_all_nine_pairs_for_240() -> None:
    p = call_case()
    assert len(p.pairs) == 9
    assert check_solutions(p)["default"] == 240 == p.upper_bound


@pytest.mark.parametrize(("v_target", "v_chain", "v_copy", "best"), [(1.2, 0, 0, 12), (3, 0, 0.75, 48), (1, 2, 0, 16)])
def test_fixed_point_chaining(v_target: float, v_chain: float, v_copy: float, best: float) -> None:
    p = Problem()
    p.sink((2, 2), "w")
    p.sink((2, 3), "x")
    (mm,) = p.fixed_point(["w", "x"], [(2, 3)], ["mm"])
    p.source((2, 2), "Sw")
    p.source((2, 3), "Sx")
    p.pair("w", "Sw", v_target)
    p.pair("x", "Sx", v_target)
    p.pair("x", mm, v_chain)
    current = p.sink((2, 3), "input")
    for name in "abc":
        (current,) = p.call([current], ["x"], [mm], v_copy, [name])
    assert check_solutions(p)["default"] == pytest.approx(best)


def test_barrier_outputs_exist_only_after_their_inputs() -> None:
    # The sink feeds the barrier, so it cannot take the barrier's (fresh) mappings.
    p = Problem()
    p.sink((3,), "s")
    (out,) = p.barrier(["s"], [(3,)], ["out"])
    p.pair("s", out, 4)
    p.source((3,), "t")
    p.sink((3,), "u")
    p.pair("u", out, 1)
    scores = check_solutions(p)
    assert scores["default"] == 3  # only u can copy the barrier's output
    assert exhaustive(p) == 3


# -- random problems against an exhaustive search ---------------------------------------------


def random_problem(rng: random.Random) -> Problem:
    p = Problem()
    tensors: list[str] = []
    for _ in range(rng.randint(1, 3)):
        tensors.append(p.source(rng.choice([(2,), (3,), (2, 2), (2, 3), (3, 2)])))
    budget = rng.randint(4, 12)
    while budget > 0:
        shape = rng.choice([(2,), (3,), (2, 2), (2, 3), (3, 2), (4,), (6,)])
        size = int(np.prod(shape))
        if size > budget:
            shape, size = (budget,), budget
        tensors.append(p.sink(shape))
        budget -= size
    for _ in range(rng.randint(2, 8)):
        x = rng.choice(tensors)
        shape = p.shapes[x]
        kind = rng.choice(
            [
                "dim_shuffle",
                "reverse",
                "reshape",
                "slice",
                "sub_sample",
                "concat",
                "expand",
                "sum_like",
                "reduce",
                "fixed",
                "barrier",
                "identity",
            ]
        )
        try:
            if kind == "dim_shuffle":
                tensors.append(p.dim_shuffle(x, list(reversed(range(len(shape))))))
            elif kind == "reverse":
                tensors.append(p.reverse(x, [0]))
            elif kind == "reshape":
                tensors.append(p.reshape(x, (int(np.prod(shape)),)))
            elif kind == "slice" and shape[0] > 1:
                tensors.append(p.slice(x, [1] + [0] * (len(shape) - 1), list(shape)))
            elif kind == "sub_sample":
                tensors.append(p.sub_sample(x, [2] + [1] * (len(shape) - 1)))
            elif kind == "concat":
                others = [t for t in tensors if p.shapes[t][1:] == shape[1:] and len(p.shapes[t]) == len(shape)]
                tensors.append(p.concat([x, rng.choice(others)], 0))
            elif kind == "expand":
                tensors.append(p.expand(x, (2, *shape)))
            elif kind == "sum_like":
                same = [t for t in tensors if p.shapes[t] == shape]
                tensors.append(p.sum_like([x, rng.choice(same)], 0))
            elif kind == "reduce" and len(shape) == 2:
                tensors.append(p.sum_like_reduce(x, (shape[1],)))
            elif kind == "fixed":
                tensors.extend(p.fixed_point([x], [shape]))
            elif kind == "barrier":
                tensors.extend(p.barrier([x], [shape]))
            elif kind == "identity":
                tensors.append(p.identity(x))
        except ProblemError:
            pass
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for t in tensors:
        by_shape.setdefault(p.shapes[t], []).append(t)
    groups = [g for g in by_shape.values() if len(g) > 1]
    for _ in range(rng.randint(2, 7)):
        if not groups:
            break
        a, b = rng.sample(rng.choice(groups), 2)
        p.pair(a, b, rng.choice([0.5, 1, 2, 3, 5, 7.25]))
    return p


def test_default_equals_exhaustive_search_on_random_problems() -> None:
    rng = random.Random(17)
    checked = 0
    while checked < 60:
        problem = random_problem(rng)
        best = exhaustive(problem, limit=20_000)
        if best is None:
            continue
        scores = check_solutions(problem)
        assert scores["default"] == pytest.approx(best), problem.ops
        checked += 1


# -- the JSON form ------------------------------------------------------------------------


def evaluation_json() -> dict:
    return {
        "ops": [
            {"op": "Sink", "id": "A", "shape": [5]},
            {"op": "Source", "id": "B", "shape": [5]},
            {"op": "Sink", "id": "C", "shape": [3]},
            {"op": "Source", "id": "D", "shape": [3]},
            {"op": "Sink", "id": "E", "shape": [3]},
        ],
        "pairs": [
            {"a": "A", "b": "B", "value": 5},
            {"a": "C", "b": "D", "value": 2},
            {"a": "C", "b": "E", "value": 7},
            {"a": "D", "b": "E", "value": 11},
        ],
    }


def graph_with_layout() -> dict:
    """A JSON graph (y = Relu(x)) whose `layout` section is the evaluation case."""
    return {
        "format": "graphopt-graph",
        "format_version": 1,
        "ir_version": 10,
        "opsets": {"": 21},
        "graph": {
            "inputs": [{"name": "x", "type": "float32[2]"}],
            "outputs": [{"name": "y", "type": "float32[2]"}],
            "nodes": [{"op": "Relu", "inputs": ["x"], "outputs": ["y"]}],
        },
        "layout": evaluation_json(),
    }


def test_json_problem_solves_like_the_built_one() -> None:
    problem = problem_from_json(evaluation_json(), "p.json")
    assert solve(problem).objective == 85


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d["ops"][1].pop("shape"), "$.ops[1]"),
        (lambda d: d["pairs"][0].update(value=-1), "$.pairs[0].value"),
        (lambda d: d["pairs"][2].update(b="nope"), "$.pairs[2]"),
        (lambda d: d["ops"].append({"op": "DimShuffle", "in": "A", "id": "X", "perm": [1, 0]}), "$.ops[5]"),
        (lambda d: d["ops"].append({"op": "Frobnicate"}), "$.ops[5].op"),
    ],
)
def test_bad_problem_files_exit_2_naming_the_json_path(tmp_path: Path, mutate, where: str) -> None:
    data = evaluation_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = invoke("unwind", path)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and str(path) in lines[0], lines


def test_cli_prints_a_table_and_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(evaluation_json()))
    result = invoke("unwind", path, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["objective"] == 85 and report["upper_bound"] == 85 and report["solver"] == "default"
    assert report["layouts"]["A"] == [{"at": 0, "count": 5, "source": "B", "index": 0, "step": 1}]
    greedy = invoke("unwind", path, "--solver", "greedy")
    assert greedy.exit_code == 0 and greedy.stdout == ""
    assert "objective" in greedy.stderr and "85" in greedy.stderr


def test_cli_reads_the_layout_section_of_a_json_graph(tmp_path: Path) -> None:
    graph = graph_with_layout()
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    result = invoke("unwind", path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["objective"] == 85
    graph["layout"]["pairs"][0]["b"] = "missing"
    path.write_text(json.dumps(graph))
    result = invoke("unwind", path)
    assert result.exit_code == 2 and "$.layout.pairs[0]" in result.output


def test_the_layout_section_survives_a_json_round_trip(tmp_path: Path) -> None:
    from graphopt.io import json_io, json_write

    graph = graph_with_layout()
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    model = json_io.load(path)
    assert model.extensions["layout"] == evaluation_json()
    json_write.save(model, tmp_path / "back.json")
    written = json.loads((tmp_path / "back.json").read_text())
    assert written["layout"] == evaluation_json() and "extensions" not in written
