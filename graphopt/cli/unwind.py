"""`graphopt unwind`: solve a layout problem and show each sink's layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

from graphopt.cli.app import cli, exit_codes, guarded, stderr
from graphopt.errors import InputError

if TYPE_CHECKING:
    from graphopt.passes.unwind.solvers import SolverName


@cli.command(epilog=exit_codes())
@click.argument("problem", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--solver",
    type=click.Choice(["default", "greedy"]),
    default="default",
    show_default=True,
    help="default: exact on small problems, look-ahead and local search on large ones; greedy: the seed's baseline.",
)
@click.option(
    "--time-budget",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    metavar="S",
    help="Seconds the default solver may search.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the solution as JSON on stdout.")
@guarded
def unwind(problem: Path, solver: SolverName, time_budget: float, as_json: bool) -> None:
    """Choose sink layouts that maximize a layout problem's objective.

    PROBLEM is a layout problem (schemas/unwind.schema.json) or a graphopt JSON graph with
    a `layout` section. Each sink's layout lists, run by run, the element whose mapping its
    elements take.

    \b
    Examples:
      graphopt unwind problem.json
      graphopt unwind problem.json --solver greedy --json > solution.json
    """
    from graphopt.passes.unwind import problem_from_json, solve

    data = _read_json(problem)
    if isinstance(data, dict) and "graph" in data:
        if "layout" not in data:
            raise InputError(f"{problem}: $: the JSON graph has no `layout` section")
        built = problem_from_json(data["layout"], str(problem), "$.layout")
    else:
        built = problem_from_json(data, str(problem))
    solution = solve(built, solver, time_budget).as_dict()
    render_solution(solution)
    if as_json:
        sys.stdout.write(json.dumps(solution, indent=2) + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None


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
