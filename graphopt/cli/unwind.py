"""`graphopt unwind`: solve a layout problem (a model's, or one given as JSON) and show each sink's layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

from graphopt.cli.app import cli, exit_codes, guarded, stderr, with_pass_options
from graphopt.errors import InputError

if TYPE_CHECKING:
    from graphopt.layout import Problem, Solution
    from graphopt.passes.unwind.layout_pass import UnwindOptions


@cli.command(epilog=exit_codes())
@click.argument("source", metavar="MODEL_OR_PROBLEM", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--problem-json", is_flag=True, help="Print the layout problem as JSON on stdout (instead of --json).")
@click.option("--json", "as_json", is_flag=True, help="Print the solution as JSON on stdout.")
@guarded
@with_pass_options("unwind")
def unwind(source: Path, options: UnwindOptions, problem_json: bool, as_json: bool) -> None:
    """Solve a layout problem: the one of an ONNX model or graphopt JSON graph (the problem
    the unwind pass solves), or one given as JSON (README.md, "Layout problems").

    Shows each sink's layout and, for a model, its Transposes before -> after. A layout
    reads run by run: `[0:16] <- x[0::3]` means the sink's elements 0 to 15 take, in
    order, the memory offsets of x's elements 0, 3, 6, ...

    \b
    Examples:
      graphopt unwind model.onnx                       # the Transposes the unwind pass would leave
      graphopt unwind model.onnx --problem-json > problem.json
      graphopt unwind problem.json --solver greedy --json > solution.json
    """
    from graphopt.layout import problem_from_json, solve
    from graphopt.layout.spec import problem_to_json

    if problem_json and as_json:
        raise InputError("--problem-json and --json exclude each other (one JSON document on stdout)")
    data = _read_json(source) if source.suffix.lower() == ".json" else None
    transposes: tuple[int, int] | None = None
    if data is None or (isinstance(data, dict) and "graph" in data and "layout" not in data):
        problem, solution, transposes = _of_model(source, options)
    elif "graph" in data:
        problem = problem_from_json(data["layout"], str(source), "$.layout")
        solution = solve(problem, options.solver, options.time_budget)
    else:
        problem = problem_from_json(data, str(source))
        solution = solve(problem, options.solver, options.time_budget)
    shown = solution.as_dict()
    render_solution(shown)
    if transposes is not None:
        stderr().print(f"Transposes {transposes[0]} -> {transposes[1]}")
    if problem_json:
        sys.stdout.write(json.dumps(problem_to_json(problem), indent=2) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")


def _of_model(source: Path, options: UnwindOptions) -> tuple[Problem, Solution, tuple[int, int]]:
    """The layout problem the unwind pass derives from the model at ``source`` (after shape
    inference, as in the default pipeline), its solution, and the Transposes before -> after."""
    from graphopt.api import optimize, pass_context
    from graphopt.io import load
    from graphopt.passes.unwind.layout_pass import solve_model

    model = optimize(load(source), "shape-infer", check=False).model
    before = sum(1 for node in model.graph if node.op_type == "Transpose")
    derivation, solution, rewrite = solve_model(model, options, pass_context())
    return derivation.problem, solution, (before, min(before, rewrite.transposes))


def _read_json(path: Path) -> Any:
    from graphopt.io.sources import input_file

    try:
        return json.loads(input_file(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    except RecursionError:  # a layout problem is a few levels deep
        raise InputError(f"{path}: nested deeper than Python's JSON parser reads") from None


def render_solution(solution: dict[str, Any]) -> None:
    console = stderr()
    table = Table(title="sink layouts", title_justify="left")
    for column in ("sink", "elements", "runs", "mappings"):
        table.add_column(column, justify="right" if column in ("elements", "runs") else "left")
    for sink, runs in solution["layouts"].items():
        shown = ", ".join(_describe(run) for run in runs[:4]) + (", ..." if len(runs) > 4 else "")
        table.add_row(escape(sink), str(sum(r["count"] for r in runs)), str(len(runs)), escape(shown))
    console.print(table)
    exact = " (optimal)" if solution["exact"] else ""
    console.print(
        f"objective {solution['objective']:g} of at most {solution['upper_bound']:g}{exact};"
        f" solver {solution['solver']}, {solution['seconds'] * 1000:.0f} ms"
    )


def _describe(run: dict[str, Any]) -> str:
    first, count = run["at"], run["count"]
    target = f"{run['source']}[{run['index']}" + (f"::{run['step']}]" if count > 1 and run["step"] != 1 else "]")
    where = f"[{first}]" if count == 1 else f"[{first}:{first + count}]"
    return f"{where} <- {'fresh ' if run.get('fresh') else ''}{target}"
