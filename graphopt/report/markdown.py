"""A run report as GitHub-flavoured Markdown, for a CI job summary (`graphopt run --markdown`,
`graphopt report show --markdown`): `>> $GITHUB_STEP_SUMMARY`.

A model's summary has its totals, the pass table, the op histogram before -> after, the fused
ops, what was not fused with the near misses by family (folded), and the numerics per
binding. A folder's (or a merged) report has its totals, a table of models, and each model's
summary folded beneath it. GitHub takes at most 1 MiB of summary per step: past
:data:`SUMMARY_LIMIT` the models at the end are left out, with a note saying how many.
"""

from __future__ import annotations

from typing import Any

from graphopt.report.console import dims_text, figure, file_bytes, size, totals_line
from graphopt.report.views import (
    criterion,
    fused_ops,
    left_undone,
    more_nodes,
    near_misses,
    op_rows,
    rows,
    verdict,
)

__all__ = ["MARKDOWN_MARK", "SUMMARY_LIMIT", "render_markdown"]

Json = dict[str, Any]

# How every summary graphopt writes begins: --markdown replaces only a file that begins so.
MARKDOWN_MARK = "<!-- graphopt report -->\n"
# GitHub's limit on one step's summary is 1 MiB; the rest of the step's summary gets the margin.
SUMMARY_LIMIT = 1024 * 1024 - 16 * 1024


def render_markdown(report: Json, limit: int = SUMMARY_LIMIT) -> str:
    """The summary of a report in its JSON form, at most ``limit`` bytes in UTF-8."""
    if "check_optimized" in report:
        return MARKDOWN_MARK + _gate(report)
    if "models" in report:
        return MARKDOWN_MARK + _folder(report, limit - len(MARKDOWN_MARK))
    return MARKDOWN_MARK + _bounded(_model(report, "##"), limit - len(MARKDOWN_MARK))


def _text(value: Any) -> str:
    """A table cell's text: pipes escaped, on one line."""
    return " ".join(str(value).replace("|", "\\|").split())


def _table(head: list[str], body: list[list[Any]], right: frozenset[int] = frozenset()) -> str:
    align = ["---:" if i in right else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_text(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _arrow(pair: tuple[int, int] | list[int], shown: Any = str) -> str:
    before, after = (shown(v) for v in pair)
    return before if before == after else f"{before} → {after}"


_MARKS = {
    "passed": "✅ passed",
    "ok": "✅ ok",
    "failed": "❌ failed",
    "check failed": "❌ check failed",
    "error": "❌ error",
}


def _mark(status: str) -> str:
    if status.startswith("passed"):
        return f"✅ {status}"  # "passed (own rounding)" too
    return _MARKS.get(status, f"⚠️ {status}")


def _model(report: Json, heading: str) -> str:
    before, after = report["summary"]["before"], report["summary"]["after"]
    source, written = report["input"], report.get("output")
    facts = [
        _mark(report["status"]),
        f"nodes {_arrow((before['nodes'], after['nodes']))}",
        f"initializers {_arrow((before['initializers'], after['initializers']))}",
        f"weights {_arrow((before['initializer_bytes'], after['initializer_bytes']), size)}",
    ]
    if written:
        facts.append(f"file {_arrow((file_bytes(source), file_bytes(written)), size)}")
    parts = [f"{heading} `{_text(source['path'])}`\n", ", ".join(facts) + "\n"]
    parts += [f"⚠️ {_text(warning)}\n" for warning in report.get("warnings", ())]  # what loading warned of
    sub = heading + "#"
    body = [
        [row.label, _arrow(row.nodes), _arrow(row.initializers), f"{row.seconds * 1000:.0f} ms", row.outcome]
        for row in rows(report)
    ]
    parts += [
        f"{sub} Pipeline\n",
        _table(["pass", "nodes", "initializers", "time", "outcome"], body, frozenset({1, 2, 3})),
    ]
    ops = op_rows(before["ops"], after["ops"])
    moved = [[f"`{r.name}`", r.before, r.after, f"{r.change:+d}"] for r in ops if r.change]
    parts.append(f"{sub} Ops before → after\n")
    if moved:
        parts.append(_table(["op", "before", "after", "change"], moved, frozenset({1, 2, 3})))
    same = ", ".join(f"{r.name} {r.after}" for r in ops if not r.change)
    if same:
        parts.append(f"unchanged: {same}\n")
    applied = fused_ops(report)
    if applied:
        parts += [f"{sub} Fused\n", ", ".join(f"`{rule}` x{n}" for rule, n in applied.items()) + "\n"]
        parts += [f"{grown.line()}\n" for grown in more_nodes(report)]
    parts += _not_fused(report, sub)
    parts += _numerics(report.get("numerics") or {}, sub)
    if report.get("failures"):
        failed = [[f.get("pass"), f.get("error")] for f in report["failures"]]
        parts += [f"{sub} Passes that failed (rolled back)\n", _table(["pass", "error"], failed)]
    return "\n".join(parts)


def _not_fused(report: Json, heading: str) -> list[str]:
    lines = [f"**{line}**\n" for line in left_undone(report, size)]
    families = near_misses(report)
    if not families and not lines:
        return []
    found = []
    for family, misses in families.items():
        body = [[m.what, m.reason, m.sites, f"`{m.where}`"] for m in misses]
        found.append(f"**{family}**\n\n" + _table(["what", "reason", "places", "e.g. at"], body, frozenset({2})))
    folded = (
        f"<details><summary>near misses by family</summary>\n\n{chr(10).join(found)}\n</details>\n" if found else ""
    )
    return [f"{heading} Not fused\n", *lines, folded]


def _numerics(numerics: Json, heading: str) -> list[str]:
    status = numerics.get("status", "skipped")
    reason = f": {numerics['reason']}" if numerics.get("reason") else ""
    judged_by = criterion(numerics)
    parts = [
        f"{heading} Numerics: {_mark(status)}\n",
        f"{reason[2:]}\n" if reason else "",
        f"criterion: {judged_by}\n" if judged_by else "",
    ]
    for number, binding in enumerate(numerics.get("bindings", []), 1):
        regimes = f"; {', '.join(binding['regimes'])}" if binding.get("regimes") else ""
        body = [
            [
                f"`{o['name']}`",
                o.get("precision", ""),
                figure(o.get("rel_l2")),
                figure(o.get("max_abs")),
                figure(o.get("cosine")),
                _mark(verdict(o)),
            ]
            for o in binding["outputs"]
        ]
        head = ["output", "precision", "rel L2", "max abs", "cosine", "verdict"]
        parts += [
            f"binding {number} ({dims_text(binding['dims'])}{regimes}):\n",
            _table(head, body, frozenset({2, 3, 4})),
        ]
    return [p for p in parts if p]


def _folder(report: Json, limit: int) -> str:
    shards = f" (shards {', '.join(report['shards'])})" if report.get("shards") else ""
    shards = f" (shard {report['shard']})" if report.get("shard") else shards
    head = f"## graphopt: {len(report['models'])} models{shards}\n\n{totals_line(report['totals'])}\n\n"
    body = []
    for row in report["models"]:
        path = f"`{row['input']['path']}`"
        if "error" in row:
            body.append([path, "", "", "", _mark("error") + ": " + row["error"]])
            continue
        before, after = row["summary"]["before"], row["summary"]["after"]
        weights = _arrow((before["initializer_bytes"], after["initializer_bytes"]), size)
        numerics = _mark(row["numerics"]["status"])
        body.append([path, _arrow((before["nodes"], after["nodes"])), weights, numerics, _mark(row["status"])])
    head += _table(["model", "nodes", "weights", "numerics", "status"], body, frozenset({1}))
    if report.get("skipped"):
        head += "\n" + _table(["skipped", "reason"], [[f"`{s['path']}`", s["reason"]] for s in report["skipped"]])
    models = [row for row in report["models"] if "error" not in row]
    sections = [
        f"<details><summary><code>{row['input']['path']}</code></summary>\n\n{_model(row, '###')}\n</details>\n"
        for row in models
    ]
    text = head + "\n"
    for shown, section in enumerate(sections):
        note = _note(f"{len(sections) - shown} of {len(sections)} models' details")
        if len((text + section + note).encode()) > limit:
            return text + note
        text += section
    return text


def _note(what: str) -> str:
    return f"\n> {what} left out: a job summary takes 1 MiB at most; the JSON report has everything.\n"


def _bounded(text: str, limit: int) -> str:
    """``text`` cut at a line to fit ``limit`` bytes, with a note, if it does not."""
    if len(text.encode()) <= limit:
        return text
    note = _note("the end of this summary")
    kept = text.encode()[: limit - len(note.encode())].decode(errors="ignore")
    return kept.rpartition("\n")[0] + "\n" + note


def _gate(report: Json) -> str:
    body = [
        [f"`{row['path']}`", "✅ optimized" if row["optimized"] else "❌ not optimized", row.get("reason") or ""]
        for row in report["check_optimized"]
    ]
    totals = f"{totals_line(report['totals'])}\n\n" if "totals" in report else ""
    return f"## graphopt --check-optimized\n\n{totals}" + _table(["model", "verdict", "reason"], body)
