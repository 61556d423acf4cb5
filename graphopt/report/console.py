"""Rich views of reports and models for people (always on stderr)."""

from __future__ import annotations

import math
import textwrap
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graphopt.errors import bounded, one_line
from graphopt.passes.pipeline import DEFAULT_MAX_STEPS
from graphopt.report.views import left_undone, more_nodes, op_rows, rows

__all__ = [
    "dims_text",
    "failure_line",
    "figure",
    "file_bytes",
    "naming",
    "render_batch",
    "render_diff",
    "render_gate",
    "render_inspection",
    "render_numerics",
    "render_ops",
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
        numerics = row["numerics"]
        if numerics["status"] == "not checked":  # a failure only under --require-check
            return f"{path}: numerics not checked (--require-check): {numerics['reason']}"
        return f"{path}: numerics failed: {numerics['reason']}"
    return None


def naming(path: str, message: str) -> str:
    """``message`` naming ``path`` once (most errors name their file already)."""
    return message if message.startswith(path) else f"{path}: {message}"


def render_report(console: Console, report: dict[str, Any]) -> None:
    """A model's run: the pass table (idle steps in one row, counts chained), then the totals,
    the op histogram before -> after, what was not fused for the opset alone and what was not
    folded for size, the file sizes, the numerics and the output written."""
    table = Table(title=escape(one_line(f"graphopt {report['input']['path']}")), title_justify="left")
    for column in ("pass", "nodes", "initializers", "time", "outcome"):
        table.add_column(column, justify="right" if column in ("nodes", "initializers", "time") else "left")
    for row in rows(report):
        shown = escape(one_line(row.outcome))  # op types are the model's names: one line whatever they hold
        if row.kind == "failed":
            shown = f"[red]{shown}[/red]"
        elif row.kind == "idle":
            shown = shown.replace("no change", "[dim]no change[/dim]", 1)
        if row.undone:
            shown += f"; [red]{escape(row.undone)}, undone[/red]"
        cells = (_arrow(list(row.nodes)), _arrow(list(row.initializers)), f"{row.seconds * 1000:.0f} ms")
        table.add_row(escape(row.label), *cells, shown)
    console.print(table)
    before, after = report["summary"]["before"], report["summary"]["after"]
    console.print(
        f"nodes {before['nodes']} -> {after['nodes']},"
        f" initializers {before['initializers']} -> {after['initializers']},"
        f" weights {size(before['initializer_bytes'])} -> {size(after['initializer_bytes'])}"
    )
    render_ops(console, before["ops"], after["ops"])
    for line in [*(grown.line() for grown in more_nodes(report)), *left_undone(report, size)]:
        console.print(escape(line))
    for line in guard_lines(report.get("runtime_guard")) + tune_lines(report.get("tune")):
        console.print(escape(one_line(line)))
    files = _file_sizes(report)
    if files:
        console.print(files)
    if report.get("through_qdq"):
        withdrawn = report["through_qdq"]
        kept = (
            "every Q/DQ pair kept"
            if withdrawn.get("every_pair_kept", True)
            else f"the {', '.join(withdrawn['families'])} fusions' Q/DQ pairs kept, the other families' fused"
        )
        console.print(
            escape(
                f"through Q/DQ: {withdrawn['withdrawn']} fusions withdrawn, {kept}: the check refused "
                f"them ({withdrawn.get('refused') or 'no reason given'})"
            )
        )
    render_numerics(console, report.get("numerics", {}))
    if report.get("blame"):
        _render_blame(console, report["blame"])
    if report.get("output"):
        cache = report.get("cache") or {}
        cached = (
            f" from the cache (the pipeline and the check above are the run of {cache['stored_seconds']:.1f} s "
            "that stored it)"
            if cache.get("status") == "hit"
            else ""
        )
        console.print(escape(one_line(f"wrote {report['output']['path']}{cached}")))


def guard_lines(guard: dict[str, Any] | None) -> list[str]:
    """What the runtime guard found (graphopt.runtime.guard): a line per rewrite undone and per
    fusion lost, or one line saying all were kept, or why it was not taken."""
    if guard is None:
        return []
    took = f"{guard['seconds']:.2f} s"
    if guard["status"] == "not taken":
        return [f"runtime guard: not taken ({guard['reason']})"]
    lines = [entry["message"] for entry in guard["undone"] + guard["lost"]]
    if not lines:
        lines = ["runtime guard: onnxruntime fuses the output as it fused the original"]
    return [*lines[:-1], f"{lines[-1]} (runtime guard {took}, {guard['reruns']} reruns)"]


def tune_lines(tune: dict[str, Any] | None) -> list[str]:
    """What --tune decided: a line per decision with its measured ratio, then the outcome."""
    if tune is None:
        return []
    lines = []
    for decision in tune["decisions"]:
        name = decision.get("rule", decision["pass"])
        measured = f" ({decision['ratio']:.3f} +- {decision['spread']:.3f})" if "ratio" in decision else ""
        lines.append(f"tune: {name} {decision['decision']}{measured}: {decision['reason']}")
    final = tune["final"]
    outcome = tune["status"]
    if final is not None and final["kept"] == "tuned":
        which = " (only the slower rewrites undone)" if final.get("undone") == "slower" else ""
        outcome = f"tuned output kept{which}, tuned / untuned {final['ratio']:.3f}"
    elif final is not None:  # the decisions above stand as measured; the output is the untuned one
        outcome = f"untuned output kept (tuned / untuned {final['ratio']:.3f}: the undoing was not faster)"
    noise = "" if tune["noise"] is None else f", noise {tune['noise']:.3f}"
    lines.append(f"tune: {outcome}{noise} ({tune['seconds']:.1f} s, {tune['rounds']} rounds)")
    if tune.get("reason"):
        lines[-1] += f": {tune['reason']}"
    return lines


def render_ops(
    console: Console,
    before: dict[str, int],
    after: dict[str, int],
    *,
    title: str = "ops",
    sides: tuple[str, str] = ("before", "after"),
) -> None:
    """The op histograms side by side: a row per op type whose count moved, then the
    unchanged ones in one line."""
    counted = op_rows(before, after)
    moved = [row for row in counted if row.change]
    if moved:
        table = Table(title=title, title_justify="left")
        for column in ("op", *sides, "change"):
            table.add_column(column, justify="left" if column == "op" else "right")
        for row in moved:
            table.add_row(escape(one_line(row.name)), str(row.before), str(row.after), f"{row.change:+d}")
        console.print(table)
    same = ", ".join(f"{row.name} {row.after}" for row in counted if not row.change)
    if same:
        console.print(escape(one_line(f"unchanged: {same}")))


def _file_sizes(report: dict[str, Any]) -> str | None:
    """The model file with its external data, before -> after (None before anything was written)."""
    source, written = report.get("input") or {}, report.get("output") or {}
    if "bytes" not in source or "bytes" not in written:
        return None
    return f"file {size(file_bytes(source))} -> {size(file_bytes(written))}"


def file_bytes(entry: dict[str, Any]) -> int:
    """A report's file entry in bytes: the model file and its external data."""
    return int(entry["bytes"]) + int(entry.get("external_data", {}).get("bytes", 0))


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
    program = numerics.get("criterion", {}).get("program")
    if program:  # a bfloat16 model, which onnxruntime's CPU provider cannot run
        line += escape(f" on {program}")
    if status == "passed" and numerics.get("passed_by"):
        line += escape(f" ({_passed_by(numerics['passed_by'], bindings)})")
    for number, binding in enumerate(bindings, 1):
        regimes = f"; {', '.join(binding['regimes'])}" if binding.get("regimes") else ""
        where = f"binding {number} ({dims_text(binding['dims'])}{regimes})"
        if per_output:
            for output in binding["outputs"]:
                figures = ", ".join(f"{label} {figure(output.get(key))}" for key, label in _FIGURES if key in output)
                mark = "ok" if output["passed"] else (output.get("reason") or "differs")
                if output["passed"] and output.get("criterion") in _FIGURES_OF:
                    mark += f" ({_FIGURES_OF[output['criterion']](output)})"
                line += escape(f"\n  {where} {output['name']}: {figures}: {mark}")
        else:
            # an output that could not be compared (its shape differs) has "nan" figures: its reason is listed below
            distances = (o.get("rel_l2") for o in binding["outputs"])
            worst = max((d for d in distances if isinstance(d, (int, float))), default=0.0)
            line += escape(f"\n  {where}: worst relative L2 {figure(worst)}")
        for output in binding["outputs"] if not per_output else ():
            if output["passed"] is not True:
                colour = "red" if output["passed"] is False else "yellow"
                problem = f"output {output['name']}: {output.get('reason') or 'differs'}"
                line += f"\n  [{colour}]{escape(problem)}[/{colour}]"
    if reason and status == "passed":
        line += escape(f"\n  note: {bounded(reason, _NOTE_LIMIT)}")
    console.print(line)


def _passed_by(criterion: str, bindings: list[dict[str, Any]]) -> str:
    """How a passed check passed: the criterion, and for the second and third the figures of the
    output nearest its bound."""
    judged = [o for b in bindings for o in b["outputs"] if o["passed"] and o.get("criterion") == criterion]
    if criterion not in _FIGURES_OF or not judged:
        return criterion
    if criterion == "own rounding":
        worst = max(judged, key=lambda o: o["rel_l2"] / o["bound"] if o["bound"] else 0.0)
        return f"within the original's own rounding: {_within(worst)}"
    worst = max(judged, key=lambda o: o["reference_optimized"] / o["reference_bound"] if o["reference_bound"] else 0.0)
    nearer = f"no further from the float reference than the original: {_nearer(worst)}"
    if criterion == "float program":
        apart = figure(max(o["reference_program"] for o in judged))
        return f"the same program in float32 (float references {apart} apart), and {nearer}"
    return nearer


def _nearer(output: dict[str, Any]) -> str:
    """``rel L2 4.3e-2 to the float reference <= 4.5e-2, the original's``."""
    optimized, bound = figure(output["reference_optimized"]), figure(output["reference_bound"])
    if output.get("criterion") == "float program" and output["reference_bound"] > output["reference_original"]:
        whose = f"the original's {figure(output['reference_original'])} give or take its rounding"
    elif output["reference_bound"] == output["reference_original"]:
        whose = "the original's"
    else:
        whose = "a self-noise run's"
    return f"rel L2 {optimized} to the original evaluated in float32 <= {bound}, {whose}"


def _within(output: dict[str, Any]) -> str:
    """``rel L2 1.5e-3 <= 3 x self-noise 9.1e-4``, or the bound's ceiling where it applied."""
    rel_l2, bound, noise = (figure(output[key]) for key in ("rel_l2", "bound", "self_noise"))
    factor = output["bound"] / output["self_noise"] if output["self_noise"] else 0.0
    if factor and math.isclose(factor, round(factor)):
        return f"rel L2 {rel_l2} <= {round(factor)} x self-noise {noise}"
    return f"rel L2 {rel_l2} <= {bound}, the ceiling (self-noise {noise})"


_FIGURES_OF = {"own rounding": _within, "float reference": _nearer, "float program": _nearer}
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


def render_gate(console: Console, report: dict[str, Any]) -> None:
    """A --check-optimized report: each model's verdict, then the totals of a batch."""
    for row in report["check_optimized"]:
        line = failure_line(row)
        console.print(escape(one_line(line)) if line else f"{escape(one_line(row['path']))}: [green]optimized[/green]")
    if "totals" in report:
        console.print(totals_line(report["totals"]))


def totals_line(totals: dict[str, Any]) -> str:
    """A batch's or a merged report's totals in one line."""
    counts = f"{_counted(totals['models'], 'model')}, {_counted(totals['failures'], 'failure')}"
    if "not_checked" in totals:
        counts += f", {totals['not_checked']} not checked"
    if "cached" in totals:
        counts += f", {totals['cached']} from the cache"
    nodes, weights = totals["nodes"], totals["initializer_bytes"]
    if totals["failures"] == totals["models"] and nodes == [0, 0]:
        return f"{counts}, nothing optimized"  # every model failed before it was read: no sizes to add up
    return f"{counts}, nodes {nodes[0]} -> {nodes[1]}, weights {size(weights[0])} -> {size(weights[1])}"


def _counted(count: int, thing: str) -> str:
    return f"{count} {thing}" if count == 1 else f"{count} {thing}s"


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
    if info.get("file_bytes") is not None:
        console.print(f"file: {size(info['file_bytes'])}")
    if info["subgraphs"]:
        console.print(f"subgraphs: {info['subgraphs']} (in {', '.join(sorted(set(info['subgraph_owners'])))})")
    if info["functions"]:
        console.print("functions: " + ", ".join(info["functions"]))


def render_diff(console: Console, found: dict[str, Any]) -> None:
    """Two models side by side (report/diff.py): what differs is shown ``a -> b``."""
    console.print(escape(f"{found['a']} -> {found['b']}"), style="bold")
    io_table = Table(title="inputs and outputs", title_justify="left")
    for column in ("kind", "name", "a", "b"):
        io_table.add_column(column)
    for kind in ("inputs", "outputs"):
        for entry in found[kind]:
            same = entry["a"] == entry["b"]
            b = "same" if same else (entry["b"] or "(none)")
            cells = (entry["name"], entry["a"] or "(none)", b)
            io_table.add_row(kind[:-1], *(escape(one_line(cell)) for cell in cells))
    console.print(io_table)
    nodes = found["nodes"]
    ops = (
        {row["op"]: row["a"] for row in found["ops"] if row["a"]},
        {row["op"]: row["b"] for row in found["ops"] if row["b"]},
    )
    render_ops(console, *ops, title=f"ops ({_arrow(nodes)} nodes)", sides=("a", "b"))
    if found["fused"]:
        console.print(escape(one_line("more in b: " + ", ".join(f"{op} +{n}" for op, n in found["fused"].items()))))
    console.print(
        f"parameters {_pair(found['parameters'], '{:,}')}, initializers {_arrow(found['initializers'])},"
        f" weights {_pair(found['parameter_bytes'], size)}, file {_pair(found['file_bytes'], size)}"
    )
    opsets = ", ".join(f"{domain or 'ai.onnx'} {_pair(pair, str)}" for domain, pair in found["opsets"].items())
    console.print(f"opsets: {opsets}; ir_version {_arrow(found['ir_version'])}")
    if found["producer"][0] != found["producer"][1]:
        console.print(escape(f"producer: {found['producer'][0]!r} -> {found['producer'][1]!r}"))


def _pair(pair: list[Any], shown: Any) -> str:
    """``a -> b`` with each side formatted by ``shown`` (a callable or a format string); one
    value when they agree, '(none)' for a side that has none."""
    show = shown.format if isinstance(shown, str) else shown
    a, b = ("(none)" if v is None else show(v) for v in pair)
    return a if a == b else f"{a} -> {b}"
