"""Rich views of reports and models for people (always on stderr)."""

from __future__ import annotations

import textwrap
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graphopt.errors import bounded, one_line
from graphopt.passes.pipeline import DEFAULT_MAX_STEPS

__all__ = [
    "dims_text",
    "failure_line",
    "figure",
    "naming",
    "render_batch",
    "render_inspection",
    "render_numerics",
    "render_passes",
    "render_report",
    "size",
    "totals_line",
]


def _arrow(pair: list[int]) -> str:
    before, after = pair
    return str(before) if before == after else f"{before} -> {after}"


def size(count: int) -> str:
    """Bytes as people read them: 4.69 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def failure_line(row: dict[str, Any]) -> str | None:
    """What went wrong with one model of a batch (a report row), naming it; None if nothing did."""
    if "optimized" in row:  # a --check-optimized row
        path = row["path"]
        if "exit_code" in row:
            return naming(path, row["reason"])
        if row["optimized"]:
            return None
        return f"{path}: not optimized: {row['reason']}; `graphopt run {path} --in-place` optimizes it"
    path = row["input"]["path"]
    if "error" in row:
        return naming(path, row["error"])
    if row.get("exit_code") == 1:
        return f"{path}: numerics failed: {row['numerics']['reason']}"
    return None


def naming(path: str, message: str) -> str:
    """``message`` naming ``path`` once (most errors name their file already)."""
    return message if message.startswith(path) else f"{path}: {message}"


def render_report(console: Console, report: dict[str, Any]) -> None:
    table = Table(title=escape(one_line(f"graphopt {report['input']['path']}")), title_justify="left")
    for column in ("pass", "nodes", "initializers", "time", "outcome"):
        table.add_column(column, justify="right" if column in ("nodes", "initializers", "time") else "left")
    for label, runs in _by_step(report["passes"]).items():
        seconds = sum(run["seconds"] for run in runs)
        nodes, initializers = (_own_change(runs, key) for key in ("nodes", "initializers"))
        shown = label + (f" x{len(runs)}" if len(runs) > 1 else "")
        table.add_row(escape(shown), _arrow(nodes), _arrow(initializers), f"{seconds * 1000:.0f} ms", _outcome(runs))
    console.print(table)
    before, after = report["summary"]["before"], report["summary"]["after"]
    console.print(
        f"nodes {before['nodes']} -> {after['nodes']},"
        f" initializers {before['initializers']} -> {after['initializers']},"
        f" weights {size(before['initializer_bytes'])} -> {size(after['initializer_bytes'])}"
    )
    render_numerics(console, report.get("numerics", {}))
    if report.get("blame"):
        _render_blame(console, report["blame"])
    if report.get("output"):
        console.print(escape(one_line(f"wrote {report['output']['path']}")))


def _own_change(runs: list[dict[str, Any]], key: str) -> list[int]:
    """Before -> after of one figure over a step's executions, counting only what they changed
    (the passes between two of them count for themselves)."""
    before = runs[0][key][0]
    return [before, before + sum(run[key][1] - run[key][0] for run in runs)]


def _by_step(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The pass executions of a report by the pipeline step they ran, labelled
    ``group/pass``; a group that occurs more than once is numbered: simplify (1), simplify (2)."""
    labelled: list[tuple[str | None, int, dict[str, Any]]] = []  # (group, its occurrence, run)
    occurrences: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()  # (pass, iteration) in the group's current occurrence
    previous: dict[str, Any] | None = None
    for run in runs:
        group = run["group"]
        if group is not None:
            key = (run["pass"], run["iteration"])
            if (
                previous is None
                or previous["group"] != group
                or run["iteration"] < previous["iteration"]
                or key in seen
            ):
                occurrences[group] = occurrences.get(group, 0) + 1  # the group starts again
                seen = set()
            seen.add(key)
        labelled.append((group, occurrences.get(group, 0) if group else 0, run))
        previous = run
    grouped: dict[str, list[dict[str, Any]]] = {}
    for group, occurrence, run in labelled:
        label = run["pass"]
        if group is not None:
            label = f"{group} ({occurrence})/{label}" if occurrences[group] > 1 else f"{group}/{label}"
        grouped.setdefault(label, []).append(run)
    return grouped


def _outcome(runs: list[dict[str, Any]]) -> str:
    """What the executions of one pipeline step did, in one line: op changes, a failure, or
    no change and, when the pass says, why; then the first part of it undone alone, if any."""
    failed = [run for run in runs if "error" in run]
    if failed:
        return f"[red]failed, rolled back: {escape(failed[0]['error'])}[/red]"
    undone = [f for run in runs for f in run.get("failures", [])]
    also = f"; [red]{escape(undone[0]['error'])}, undone[/red]" if undone else ""
    delta: dict[str, int] = {}
    for run in runs:
        for op, count in run["op_delta"].items():
            delta[op] = delta.get(op, 0) + count
    changes = ", ".join(f"{op} {d:+d}" for op, d in sorted(delta.items(), key=lambda kv: kv[1]) if d)
    if any(run["changed"] for run in runs):
        return escape(changes or "changed, no op count moved") + also
    why = _why_unchanged(runs[-1]["details"])
    return "[dim]no change[/dim]" + (escape(f": {why}") if why else "") + also


def _why_unchanged(details: dict[str, Any]) -> str | None:
    """A pass's own word on why it changed nothing: a ``reason``, or its ``refused`` list."""
    if isinstance(details.get("reason"), str):
        return str(details["reason"])
    refused = details.get("refused")
    if isinstance(refused, list) and refused:
        reasons = dict.fromkeys(str(r.get("reason")) for r in refused if isinstance(r, dict) and r.get("reason"))
        what = ", ".join(reasons) or "see the report"
        return f"refused {len(refused)} candidate{'s' if len(refused) > 1 else ''}: {what}"
    return None


def render_numerics(console: Console, numerics: dict[str, Any], *, per_output: bool = False) -> None:
    """The check's outcome: the status (a failure's reason on the same line), each binding's
    worst relative L2 (``per_output``: every output's figures), the outputs that did not pass,
    and what a passed check noted (an ORT message bounded)."""
    status = numerics.get("status", "skipped")
    colour = {"passed": "green", "failed": "red"}.get(status, "yellow")
    line = f"numerics: [{colour}]{status}[/{colour}]"
    reason = numerics.get("reason")
    if reason and status != "passed":
        line += escape(f" ({reason})")
    bindings = numerics.get("bindings", [])
    for number, binding in enumerate(bindings, 1):
        regimes = f"; {', '.join(binding['regimes'])}" if binding.get("regimes") else ""
        where = f"binding {number} ({dims_text(binding['dims'])}{regimes})"
        if per_output:
            for output in binding["outputs"]:
                figures = ", ".join(f"{label} {figure(output.get(key))}" for key, label in _FIGURES if key in output)
                mark = "ok" if output["passed"] else (output.get("reason") or "differs")
                line += escape(f"\n  {where} {output['name']}: {figures}: {mark}")
        else:
            worst = max((o["rel_l2"] for o in binding["outputs"] if o.get("rel_l2") is not None), default=0.0)
            line += escape(f"\n  {where}: worst relative L2 {figure(worst)}")
        for output in binding["outputs"] if not per_output else ():
            if output["passed"] is not True:
                colour = "red" if output["passed"] is False else "yellow"
                problem = f"output {output['name']}: {output.get('reason') or 'differs'}"
                line += f"\n  [{colour}]{escape(problem)}[/{colour}]"
    if reason and status == "passed":
        line += escape(f"\n  note: {bounded(reason, _NOTE_LIMIT)}")
    console.print(line)


_NOTE_LIMIT = 240  # a note beside a passed check, onnxruntime's message about a binding it could not run


def dims_text(dims: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in dims.items()) or "static dims"


def figure(value: Any) -> str:
    """A number as every command prints it: three significant digits (9.51e-08), enough
    digits to tell a cosine from 1 (0.999699), integers whole."""
    if isinstance(value, bool) or not isinstance(value, float):
        return "-" if value is None else str(value)
    if 0.99 < abs(value) < 1:
        return f"{value:.6f}"
    return f"{value:.3g}"


_FIGURES = (("rel_l2", "rel L2"), ("max_abs", "max abs"), ("p99_abs", "p99 abs"), ("cosine", "cosine"))


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
            + ", ".join(f"{label} {figure(divergence[key])}" for key, label in _FIGURES)
        )
    )


def render_batch(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="graphopt batch", title_justify="left")
    for column in ("model", "nodes", "numerics", "status"):
        table.add_column(column)
    for row in report["models"]:
        if "error" in row:
            table.add_row(
                escape(one_line(row["input"]["path"])), "", "", f"[red]{escape(one_line(row['error']))}[/red]"
            )
            continue
        summary = row["summary"]
        nodes = f"{summary['before']['nodes']} -> {summary['after']['nodes']}"
        table.add_row(escape(one_line(row["input"]["path"])), nodes, row["numerics"]["status"], row["status"])
    console.print(table)
    console.print(totals_line(report["totals"]))


def totals_line(totals: dict[str, Any]) -> str:
    """A batch's or a merged report's totals in one line."""
    counts = f"{totals['models']} models, {totals['failures']} failures"
    if "not_checked" in totals:
        counts += f", {totals['not_checked']} not checked"
    nodes, weights = totals["nodes"], totals["initializer_bytes"]
    return f"{counts}, nodes {nodes[0]} -> {nodes[1]}, weights {size(weights[0])} -> {size(weights[1])}"


_WIDTH = 100  # of the pass listing: a product on stdout, read in terminals and pipes alike


def render_passes(
    console: Console, passes: list[dict[str, Any]], pipeline: list[dict[str, Any]] | None, *, detailed: bool
) -> None:
    """The passes as plain lines (no table: the listing goes through pipes); ``detailed``
    adds each rule of a pass on one line."""
    out: list[str] = []
    for entry in passes:
        out += textwrap.wrap(
            f"{entry['name']}: {entry['description']}", _WIDTH, subsequent_indent="    ", break_on_hyphens=False
        )
        for option in entry["options"]:
            text = f"option {option['name']} ({option['type']}, default {option['default']!r}): {option['help']}"
            out += textwrap.wrap(text, _WIDTH, initial_indent="  ", subsequent_indent="      ")
        rules = entry.get("rules", [])
        if rules and not detailed:
            families = ", ".join(dict.fromkeys(rule["family"] for rule in rules))
            text = f"rule families ({len(rules)} rules; `graphopt passes {entry['name']}` lists them): {families}"
            out += textwrap.wrap(text, _WIDTH, initial_indent="  ", subsequent_indent="      ")
        if rules and detailed:
            out.append(f"  rules ({len(rules)}), by name: what the enable / disable options take, as do their families")
            width = max(len(rule["name"]) for rule in rules)
            family_width = max(len(rule["family"]) for rule in rules)
            out += [
                f"  {rule['name']:<{width}}  {rule['family']:<{family_width}}  {rule['doc']}"
                + ("" if rule["default"] else " [off by default]")
                for rule in rules
            ]
        out.append("")
    if pipeline is not None:
        out.append("default pipeline:")
        for step in pipeline:  # a long group wraps between its steps, never inside a step's options
            lines = textwrap.wrap(
                _step_text(step), _WIDTH, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
            )
            out += [line.replace(_UNBROKEN_SPACE, " ") for line in lines]
    console.print(escape("\n".join(out).rstrip("\n")), soft_wrap=True)


_UNBROKEN_SPACE = "\N{NO-BREAK SPACE}"  # textwrap breaks lines at ASCII spaces only


def _step_text(step: dict[str, Any]) -> str:
    if "group" not in step:
        options = step.get("options")
        return step["pass"] + (f" {options}".replace(" ", _UNBROKEN_SPACE) if options else "")
    inner = ", ".join(_step_text(s) for s in step["steps"])
    return f"{step['group']} ({inner}), up to {step.get('max_steps', DEFAULT_MAX_STEPS)} rounds"


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
    held = f"{info['initializers']} initializers" + (
        f" and {info['constant_nodes']} Constant nodes" if info["constant_nodes"] else ""
    )
    console.print(f"parameters: {info['parameters']:,} ({size(info['parameter_bytes'])}) in {held}")
    if info["subgraphs"]:
        console.print(f"subgraphs: {info['subgraphs']} (in {', '.join(sorted(set(info['subgraph_owners'])))})")
    if info["functions"]:
        console.print("functions: " + ", ".join(info["functions"]))
