"""Rich views of reports and models for people (always on stderr)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["render_batch", "render_inspection", "render_passes", "render_report", "totals_line"]


def _arrow(pair: list[int]) -> str:
    before, after = pair
    return str(before) if before == after else f"{before} -> {after}"


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def render_report(console: Console, report: dict[str, Any]) -> None:
    table = Table(title=escape(f"graphopt {report['input']['path']}"), title_justify="left")
    for column in ("pass", "nodes", "initializers", "time", "op changes"):
        table.add_column(column, justify="right" if column in ("nodes", "initializers", "time") else "left")
    for run in report["passes"]:
        if not run["changed"] and "error" not in run:
            continue
        label = run["pass"] if run["group"] is None else f"{run['group']}/{run['pass']} #{run['iteration'] + 1}"
        delta = ", ".join(f"{op} {d:+d}" for op, d in sorted(run["op_delta"].items(), key=lambda kv: kv[1]))
        if "error" in run:
            delta = f"[red]failed, rolled back: {escape(run['error'])}[/red]"
        table.add_row(
            label, _arrow(run["nodes"]), _arrow(run["initializers"]), f"{run['seconds'] * 1000:.0f} ms", delta
        )
    console.print(table)
    before, after = report["summary"]["before"], report["summary"]["after"]
    console.print(
        f"nodes {before['nodes']} -> {after['nodes']},"
        f" initializers {before['initializers']} -> {after['initializers']},"
        f" weights {_size(before['initializer_bytes'])} -> {_size(after['initializer_bytes'])}"
    )
    numerics = report.get("numerics", {})
    status = numerics.get("status", "skipped")
    colour = {"passed": "green", "failed": "red"}.get(status, "yellow")
    line = f"numerics: [{colour}]{status}[/{colour}]"
    if numerics.get("reason"):
        line += escape(f" ({numerics['reason']})")
    for binding in numerics.get("bindings", []):
        worst = max((o["rel_l2"] for o in binding["outputs"] if o.get("rel_l2") is not None), default=0.0)
        line += f"\n  dims {binding['dims']}: worst relative L2 {worst:.2e}"
        for output in binding["outputs"]:
            if output["passed"] is not True:
                colour = "red" if output["passed"] is False else "yellow"
                problem = f"output {output['name']}: {output.get('reason') or 'differs'}"
                line += f"\n  [{colour}]{escape(problem)}[/{colour}]"
    console.print(line)
    if report.get("blame"):
        _render_blame(console, report["blame"])
    if report.get("output"):
        console.print(escape(f"wrote {report['output']['path']}"))


_FIGURES = (("rel_l2", "rel L2"), ("max_abs", "max abs"), ("p99_abs", "p99 abs"), ("cosine", "cosine"))


def _figure(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _render_blame(console: Console, blame: dict[str, Any]) -> None:
    if blame.get("pass") is None:
        console.print(escape(f"blame: {blame.get('reason')}"))
        return
    console.print(
        f"first pass that broke numerics: [bold]{escape(blame['pass'])}[/bold]"
        f" (execution {blame['execution']} of {blame['executions']}, found in {blame['reruns']} reruns)"
    )
    divergence = blame.get("divergence") or {}
    if divergence.get("node") is None:
        console.print(escape(f"first diverging node: none named ({divergence.get('reason')})"))
        return
    console.print(
        f"first diverging node: [bold]{escape(divergence['node'] or '(unnamed)')}[/bold]"
        + escape(
            f" ({divergence['op_type']}, output {divergence['output']}): "
            + ", ".join(f"{label} {_figure(divergence[key])}" for key, label in _FIGURES)
        )
    )


def render_batch(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="graphopt batch", title_justify="left")
    for column in ("model", "nodes", "numerics", "status"):
        table.add_column(column)
    for row in report["models"]:
        if "error" in row:
            table.add_row(escape(row["input"]["path"]), "", "", f"[red]{escape(row['error'])}[/red]")
            continue
        summary = row["summary"]
        nodes = f"{summary['before']['nodes']} -> {summary['after']['nodes']}"
        table.add_row(escape(row["input"]["path"]), nodes, row["numerics"]["status"], row["status"])
    console.print(table)
    console.print(totals_line(report["totals"]))


def totals_line(totals: dict[str, Any]) -> str:
    """A batch's or a merged report's totals in one line."""
    counts = f"{totals['models']} models, {totals['failures']} failures"
    if "not_checked" in totals:
        counts += f", {totals['not_checked']} not checked"
    nodes, weights = totals["nodes"], totals["initializer_bytes"]
    return f"{counts}, nodes {nodes[0]} -> {nodes[1]}, weight bytes {weights[0]} -> {weights[1]}"


def render_passes(console: Console, passes: list[dict[str, Any]]) -> None:
    table = Table(title="passes", title_justify="left", show_lines=True)
    table.add_column("pass")
    table.add_column("what it does")
    table.add_column("options")
    for entry in passes:
        options = "\n".join(
            f"{o['name']} ({o['type']}, default {o['default']!r}): {o['help']}" for o in entry["options"]
        )
        table.add_row(entry["name"], escape(entry["description"]), escape(options) or "-")
    console.print(table)


def render_inspection(console: Console, info: dict[str, Any]) -> None:
    console.print(
        f"[bold]{escape(info['path'])}[/bold]  ir_version {info['ir_version']}, producer {info['producer']!r}"
    )
    console.print("opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in info["opsets"].items()))
    io_table = Table(title="inputs and outputs", title_justify="left")
    io_table.add_column("kind")
    io_table.add_column("name")
    io_table.add_column("type")
    for kind in ("inputs", "outputs"):
        for entry in info[kind]:
            io_table.add_row(kind[:-1], escape(entry["name"]), escape(entry["type"]))
    console.print(io_table)
    ops = Table(title=f"{info['nodes']} nodes", title_justify="left")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in sorted(info["ops"].items(), key=lambda kv: (-kv[1], kv[0])):
        ops.add_row(op, str(count))
    console.print(ops)
    console.print(
        f"parameters: {info['parameters']:,} in {info['initializers']} initializers ({_size(info['parameter_bytes'])})"
    )
    if info["subgraphs"]:
        console.print(f"subgraphs: {info['subgraphs']} (in {', '.join(sorted(set(info['subgraph_owners'])))})")
    if info["functions"]:
        console.print("functions: " + ", ".join(info["functions"]))
