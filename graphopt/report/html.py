"""A run report as one self-contained HTML page (`graphopt run --html`, `graphopt report show --html`).

Nothing is fetched: the styles are inline, the charts inline SVG, and a few lines of inline
script sort the table of models. A model's page shows the pipeline as a chart of nodes per
step, the op histogram before / after as bars, the fused ops, what was not fused and the near
misses by family, and the numerics per binding; a folder's (or a merged) report shows its
totals and a sortable table of models, each model's page folded beneath it.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from graphopt.report.console import dims_text, figure, file_bytes, size, totals_line
from graphopt.report.views import (
    Counted,
    criterion,
    fused_ops,
    left_undone,
    more_nodes,
    near_misses,
    op_rows,
    rows,
    verdict,
)

__all__ = ["HTML_MARK", "render_html"]

Json = dict[str, Any]

# How every page graphopt writes begins: --html replaces only a file that begins so.
HTML_MARK = "<!DOCTYPE html>\n<!-- graphopt report -->\n"

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; max-width: 1100px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 14px; margin: 16px 0 6px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { border: 1px solid #d0d7de; padding: 3px 8px; }
th { background: #f6f8fa; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
th[data-sort] { cursor: pointer; } .muted { color: #656d76; } code { font-size: 12px; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #cf222e; font-weight: 600; }
.warn { color: #9a6700; font-weight: 600; }
svg text { font: 11px system-ui, sans-serif; fill: #1f2328; } details { margin: 6px 0; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; }
"""

# Sorts a table by the column clicked (numbers by their data-v value), again to reverse.
_SCRIPT = """
document.querySelectorAll("th[data-sort]").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0], i = th.cellIndex;
    var down = th.dataset.dir !== "down"; th.dataset.dir = down ? "down" : "up";
    var key = function (row) { var c = row.cells[i]; return c.dataset.v !== undefined ? +c.dataset.v : c.textContent; };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * (down ? -1 : 1);
    }).forEach(function (row) { body.appendChild(row); });
  });
});
"""

_BEFORE, _AFTER = "#afb8c1", "#0969da"


def render_html(report: Json) -> str:
    """The page of a report in its JSON form: one model's, a folder's, a merged one or the gate's."""
    if "check_optimized" in report:
        title, body = "graphopt --check-optimized", _gate(report)
    elif "models" in report:
        title, body = "graphopt: " + totals_line(report["totals"]), _folder(report)
    else:
        title, body = f"graphopt {report['input']['path']}", _model(report, level=1)
    return (
        f'{HTML_MARK}<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="generator" content="graphopt {escape(str(report.get("graphopt_version", "")))}">'
        f"<style>{_STYLE}</style></head><body>\n{body}\n<script>{_SCRIPT}</script></body></html>\n"
    )


def _status(status: str) -> str:
    if status.startswith("passed"):  # "passed (own rounding)" too
        return f'<span class="ok">{escape(status)}</span>'
    css = {"ok": "ok", "optimized": "ok", "failed": "bad", "error": "bad", "check failed": "bad"}
    return f'<span class="{css.get(status, "warn")}">{escape(status)}</span>'


def _table(
    head: list[str], body: list[list[str]], *, sortable: bool = False, numeric: frozenset[int] = frozenset()
) -> str:
    """A table of cells given as HTML; columns in ``numeric`` align right."""
    sort = " data-sort" if sortable else ""
    heads = "".join(f"<th{sort}>{escape(h)}</th>" for h in head)
    lines = [
        "<tr>" + "".join(f'<td class="n"{c}' if i in numeric else f"<td{c}" for i, c in enumerate(row)) + "</tr>"
        for row in body
    ]
    return f"<table><thead><tr>{heads}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _cell(text: Any, value: float | None = None) -> str:
    """The rest of a ``<td`` tag: a sort value, then the escaped text and the closing tag."""
    key = f' data-v="{value}"' if value is not None else ""
    return f"{key}>{escape(str(text))}</td>"


def _raw(html: str, value: float | None = None) -> str:
    key = f' data-v="{value}"' if value is not None else ""
    return f"{key}>{html}</td>"


def _arrow(pair: tuple[int, int] | list[int], shown: Any = str) -> str:
    before, after = (shown(v) for v in pair)
    return before if before == after else f"{before} → {after}"


def _model(report: Json, level: int) -> str:
    head = f"h{level}"
    before, after = report["summary"]["before"], report["summary"]["after"]
    source, written = report["input"], report.get("output")
    parts = [f"<{head}>{escape(source['path'])}</{head}>"]
    facts = [
        f"status {_status(report['status'])}",
        f"nodes {_arrow((before['nodes'], after['nodes']))}",
        f"initializers {_arrow((before['initializers'], after['initializers']))}",
        f"weights {escape(_arrow((before['initializer_bytes'], after['initializer_bytes']), size))}",
    ]
    if written:
        facts.append(f"file {escape(_arrow((file_bytes(source), file_bytes(written)), size))}")
        facts.append(f"written to <code>{escape(written['path'])}</code>")
    parts.append(f"<p>{', '.join(facts)}</p>")
    sub = f"h{level + 1}"
    parts += [f"<{sub}>Pipeline: nodes per step</{sub}>", _pipeline_chart(report), _pipeline_table(report)]
    parts += [f"<{sub}>Ops before / after</{sub}>", _pair_bars(op_rows(before["ops"], after["ops"]), "ops")]
    parts += [f"<{sub}>Fused</{sub}>", _fused(report)]
    parts += [f"<{sub}>Numerics</{sub}>", _numerics(report.get("numerics") or {})]
    parts += [f"<{sub}>Not fused: near misses by family</{sub}>", _near_misses(report)]
    if report.get("failures"):
        failed = [[_cell(f.get("pass")), _cell(f.get("error"))] for f in report["failures"]]
        parts += [f"<{sub}>Passes that failed (rolled back)</{sub}>", _table(["pass", "error"], failed)]
    return "\n".join(parts)


def _pipeline_chart(report: Json) -> str:
    """Bars of the nodes after each step (the first bar: the model as read)."""
    found = rows(report)
    if not found:
        return '<p class="muted">no pass ran</p>'
    bars = [("read", found[0].nodes[0])] + [(row.label, row.nodes[1]) for row in found]
    top = max(count for _, count in bars) or 1
    width, height, left, bottom = 34, 180, 44, 150
    box = f'width="{left + width * len(bars) + 160}" height="{height + bottom}"'
    svg = [f'<svg {box} role="img" aria-label="nodes per step">']
    svg.append(f'<line x1="{left}" y1="{height}" x2="{left + width * len(bars)}" y2="{height}" stroke="#d0d7de"/>')
    for i, (label, count) in enumerate(bars):
        h = max(1, round(count / top * (height - 20)))
        x = left + i * width + 4
        fill = _BEFORE if i == 0 else _AFTER
        tip = f"<title>{escape(label)}: {count}</title>"
        svg.append(f'<rect x="{x}" y="{height - h}" width="{width - 8}" height="{h}" fill="{fill}">{tip}</rect>')
        svg.append(f'<text x="{x + (width - 8) / 2}" y="{height - h - 3}" text-anchor="middle">{count}</text>')
        short = label if len(label) <= 28 else label[:27] + "…"
        svg.append(f'<text transform="translate({x + 10},{height + 8}) rotate(50)">{escape(short)}</text>')
    svg.append("</svg>")
    return "".join(svg)


def _pipeline_table(report: Json) -> str:
    body = [
        [
            _cell(row.label),
            _cell(_arrow(row.nodes)),
            _cell(_arrow(row.initializers)),
            _cell(f"{row.seconds * 1000:.0f} ms"),
            _cell(row.outcome + (f"; {row.undone}, undone" if row.undone else "")),
        ]
        for row in rows(report)
    ]
    table = _table(["pass", "nodes", "initializers", "time", "outcome"], body, numeric=frozenset({1, 2, 3}))
    return f"<details><summary>the steps</summary>{table}</details>"


def _pair_bars(pairs: list[Counted], what: str) -> str:
    """Two horizontal bars per row, before and after, with the counts beside them."""
    if not pairs:
        return f'<p class="muted">no {what}</p>'
    top = max(max(r.before, r.after) for r in pairs) or 1
    label_width, bar_width, row_height = 190, 520, 22
    keys = "".join(
        f'<span style="background:{fill}"></span>{side}' for side, fill in (("before", _BEFORE), ("after", _AFTER))
    )
    box = f'width="{label_width + bar_width + 120}" height="{row_height * len(pairs) + 4}"'
    svg = [f'<p class="legend">{keys}</p><svg {box} role="img" aria-label="{what} before and after">']
    for i, r in enumerate(pairs):
        y = i * row_height + 2
        name = r.name if len(r.name) <= 30 else "…" + r.name[-29:]
        svg.append(f'<text x="{label_width - 6}" y="{y + 14}" text-anchor="end">{escape(name)}</text>')
        for j, (count, fill) in enumerate(((r.before, _BEFORE), (r.after, _AFTER))):
            w = round(count / top * bar_width)
            svg.append(f'<rect x="{label_width}" y="{y + j * 9}" width="{w}" height="8" fill="{fill}"/>')
        change = f" ({r.change:+d})" if r.change else ""
        end = label_width + round(max(r.before, r.after) / top * bar_width) + 6
        svg.append(f'<text x="{end}" y="{y + 14}">{r.before} → {r.after}{change}</text>')
    svg.append("</svg>")
    return "".join(svg)


def _fused(report: Json) -> str:
    applied = fused_ops(report)
    grown = [r for r in op_rows(report["summary"]["before"]["ops"], report["summary"]["after"]["ops"]) if r.change > 0]
    parts = []
    if applied:
        parts.append(
            _table(
                ["rule", "matches"], [[_cell(rule), _cell(n)] for rule, n in applied.items()], numeric=frozenset({1})
            )
        )
    if grown:
        parts.append("<p>ops added: " + ", ".join(f"{escape(r.name)} +{r.change}" for r in grown) + "</p>")
    parts += [f"<p>{escape(more.line())}</p>" for more in more_nodes(report)]
    return "".join(parts) or '<p class="muted">nothing fused</p>'


def _near_misses(report: Json) -> str:
    parts = [f"<p><b>{escape(line)}</b></p>" for line in left_undone(report, size)]
    for family, misses in near_misses(report).items():
        body = [[_cell(m.what), _cell(m.reason), _cell(m.sites), _cell(m.where)] for m in misses]
        parts.append(
            f"<h3>{escape(family)}</h3>" + _table(["what", "reason", "places", "e.g. at"], body, numeric=frozenset({2}))
        )
    return "".join(parts) or '<p class="muted">no near misses</p>'


_FIGURES = (("rel_l2", "rel L2"), ("max_abs", "max abs"), ("cosine", "cosine"))


def _numerics(numerics: Json) -> str:
    status = numerics.get("status", "skipped")
    parts = [
        f"<p>{_status(status)}" + (f": {escape(str(numerics['reason']))}" if numerics.get("reason") else "") + "</p>"
    ]
    judged_by = criterion(numerics)
    if judged_by:
        parts.append(f'<p class="muted">criterion: {escape(judged_by)}</p>')
    for number, binding in enumerate(numerics.get("bindings", []), 1):
        regimes = f"; {', '.join(binding['regimes'])}" if binding.get("regimes") else ""
        parts.append(f"<h3>binding {number}: {escape(dims_text(binding['dims']) + regimes)}</h3>")
        body = [
            [_cell(o["name"]), _cell(o.get("precision", ""))]
            + [_cell(figure(o.get(key)), o.get(key) if isinstance(o.get(key), float) else None) for key, _ in _FIGURES]
            + [
                _raw(_status(verdict(o))),
                _cell(o.get("reason") or ""),
            ]
            for o in binding["outputs"]
        ]
        head = ["output", "precision", *(label for _, label in _FIGURES), "verdict", "reason"]
        parts.append(_table(head, body, numeric=frozenset({2, 3, 4})))
    return "".join(parts)


def _folder(report: Json) -> str:
    totals = report["totals"]
    shards = (
        f" (shards {', '.join(report['shards'])})"
        if report.get("shards")
        else f" (shard {report['shard']})"
        if report.get("shard")
        else ""
    )
    parts = [
        f"<h1>graphopt: {len(report['models'])} models{escape(shards)}</h1>",
        f"<p>{escape(totals_line(totals))}</p>",
    ]
    body = []
    for row in report["models"]:
        path = row["input"]["path"]
        if "error" in row:
            body.append([_cell(path), _cell(""), _cell(""), _cell(""), _cell(row["error"]), _raw(_status("error"))])
            continue
        before, after = row["summary"]["before"], row["summary"]["after"]
        ratio = after["nodes"] / before["nodes"] if before["nodes"] else 1.0
        body.append(
            [
                _cell(path),
                _cell(f"{before['nodes']} → {after['nodes']}", after["nodes"]),
                _cell(f"{ratio:.2f}", ratio),
                _cell(
                    f"{size(before['initializer_bytes'])} → {size(after['initializer_bytes'])}",
                    after["initializer_bytes"],
                ),
                _raw(_status(row["numerics"]["status"])),
                _raw(_status(row["status"])),
            ]
        )
    head = ["model", "nodes", "after / before", "weights", "numerics", "status"]
    parts.append(
        '<p class="muted">click a column to sort</p>' + _table(head, body, sortable=True, numeric=frozenset({1, 2, 3}))
    )
    if report.get("skipped"):
        parts.append(
            "<h2>Skipped</h2>"
            + _table(["file", "reason"], [[_cell(s["path"]), _cell(s["reason"])] for s in report["skipped"]])
        )
    models = [row for row in report["models"] if "error" not in row]
    if models:
        nodes = [
            Counted(Path(r["input"]["path"]).name, r["summary"]["before"]["nodes"], r["summary"]["after"]["nodes"])
            for r in models
        ]
        parts += ["<h2>Nodes per model</h2>", _pair_bars(nodes, "nodes")]
        parts.append("<h2>Models</h2>")
        parts += [
            f"<details><summary>{escape(row['input']['path'])}</summary>{_model(row, level=3)}</details>"
            for row in models
        ]
    return "\n".join(parts)


def _gate(report: Json) -> str:
    body = [
        [
            _cell(row["path"]),
            _raw(_status("optimized" if row["optimized"] else "not optimized")),
            _cell(row.get("reason") or ""),
        ]
        for row in report["check_optimized"]
    ]
    parts = ["<h1>graphopt --check-optimized</h1>"]
    if "totals" in report:
        parts.append(f"<p>{escape(totals_line(report['totals']))}</p>")
    parts.append(_table(["model", "verdict", "reason"], body, sortable=True))
    return "\n".join(parts)
