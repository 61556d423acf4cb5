"""What every view of a run report shows, read once from its JSON form: the pipeline's steps
with chained counts, the op histogram before -> after, the fused ops, the near misses and what
was not fused for the opset alone, with the option that would fuse it.

The console (console.py), the HTML page (html.py) and the Markdown summary (markdown.py) all
draw from these, so that they agree with each other and with the JSON.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KeptSmall",
    "MoreNodes",
    "NearMiss",
    "NotFused",
    "Counted",
    "Row",
    "Step",
    "criterion",
    "fused_ops",
    "kept_small",
    "left_undone",
    "more_nodes",
    "near_misses",
    "not_fused",
    "op_rows",
    "rows",
    "steps",
    "verdict",
]

Json = dict[str, Any]


@dataclass(frozen=True)
class Step:
    """One step of the pipeline as run (a pass, or a pass of a group's occurrence with all
    its rounds): nodes and initializers before -> after, chained (each step's before is the
    previous step's after; a step counts only its own changes), and what it did."""

    label: str
    executions: int
    nodes: tuple[int, int]
    initializers: tuple[int, int]
    seconds: float
    changed: bool
    op_delta: dict[str, int]
    error: str | None  # the first execution that failed and was rolled back
    undone: str | None  # the first rewrite undone alone
    why: str | None  # a pass's own word on why it changed nothing

    @property
    def idle(self) -> bool:
        """Did nothing at all: no change, no failure."""
        return not self.changed and self.error is None and self.undone is None


def steps(report: Json) -> list[Step]:
    """The steps of a model's report, in pipeline order, with chained counts."""
    found: list[Step] = []
    nodes = initializers = None
    for label, runs in _by_step(report["passes"]).items():
        nodes = runs[0]["nodes"][0] if nodes is None else nodes
        initializers = runs[0]["initializers"][0] if initializers is None else initializers
        node_change = sum(run["nodes"][1] - run["nodes"][0] for run in runs)
        initializer_change = sum(run["initializers"][1] - run["initializers"][0] for run in runs)
        delta: Counter[str] = Counter()
        for run in runs:
            delta.update(run["op_delta"])
        failed = [run["error"] for run in runs if "error" in run]
        undone = [f["error"] for run in runs for f in run.get("failures", [])]
        found.append(
            Step(
                label=label,
                executions=len(runs),
                nodes=(nodes, nodes + node_change),
                initializers=(initializers, initializers + initializer_change),
                seconds=sum(run["seconds"] for run in runs),
                changed=any(run["changed"] for run in runs),
                op_delta={op: d for op, d in sorted(delta.items(), key=lambda kv: (kv[1], kv[0])) if d},
                error=failed[0] if failed else None,
                undone=undone[0] if undone else None,
                why=_why_unchanged(runs[-1]["details"]),
            )
        )
        nodes, initializers = nodes + node_change, initializers + initializer_change
    return found


@dataclass(frozen=True)
class Row:
    """A row of a pass table: one step, or consecutive steps that all did nothing."""

    label: str
    steps: list[Step]

    @property
    def nodes(self) -> tuple[int, int]:
        return self.steps[0].nodes[0], self.steps[-1].nodes[1]

    @property
    def initializers(self) -> tuple[int, int]:
        return self.steps[0].initializers[0], self.steps[-1].initializers[1]

    @property
    def seconds(self) -> float:
        return sum(step.seconds for step in self.steps)

    @property
    def kind(self) -> str:
        """ "failed" (rolled back), "changed", or "idle"."""
        step = self.steps[0]
        return "failed" if step.error is not None else "changed" if step.changed else "idle"

    @property
    def outcome(self) -> str:
        """What the row's steps did, in one line: op changes, a failure, or no change and,
        when the passes say, why (the first rewrite undone alone is in :attr:`undone`)."""
        step = self.steps[0]
        if len(self.steps) > 1:
            whys = "; ".join(f"{s.label}: {s.why}" for s in self.steps if s.why)
            return "no change" + (f" ({whys})" if whys else "")
        if step.error is not None:
            return f"failed, rolled back: {step.error}"
        if step.changed:
            return ", ".join(f"{op} {d:+d}" for op, d in step.op_delta.items()) or "changed, no op count moved"
        return "no change" + (f": {step.why}" if step.why else "")

    @property
    def undone(self) -> str | None:
        return self.steps[0].undone if len(self.steps) == 1 and self.steps[0].error is None else None


def rows(report: Json) -> list[Row]:
    """The pass table of a model's report: a row per step, consecutive idle steps in one row
    (a whole group occurrence by its name, ``simplify (2)``)."""
    found = steps(report)
    runs: list[list[Step]] = []
    for step in found:
        if runs and step.idle and runs[-1][-1].idle:
            runs[-1].append(step)
        else:
            runs.append([step])
    per_group = Counter(step.label.rpartition("/")[0] for step in found)
    return [Row(_row_label(run, per_group), run) for run in runs]


def _row_label(run: list[Step], per_group: Counter[str]) -> str:
    """``fuse x2`` for one step run twice; a whole group occurrence by its name, otherwise
    each step by its label."""
    if len(run) == 1:
        return run[0].label + (f" x{run[0].executions}" if run[0].executions > 1 else "")
    labels: list[str] = []
    for step in run:
        group = step.label.rpartition("/")[0]
        if group and sum(1 for s in run if s.label.rpartition("/")[0] == group) == per_group[group]:
            if group not in labels:
                labels.append(group)
        else:
            labels.append(step.label)
    return ", ".join(labels)


def _by_step(runs: list[Json]) -> dict[str, list[Json]]:
    """The pass executions of a report by the pipeline step they ran, labelled
    ``group/pass``; a group that occurs more than once is numbered: simplify (1), simplify (2)."""
    labelled: list[tuple[str | None, int, Json]] = []  # (group, its occurrence, run)
    occurrences: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()  # (pass, iteration) in the group's current occurrence
    previous: Json | None = None
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
    grouped: dict[str, list[Json]] = {}
    for group, occurrence, run in labelled:
        label = run["pass"]
        if group is not None:
            label = f"{group} ({occurrence})/{label}" if occurrences[group] > 1 else f"{group}/{label}"
        grouped.setdefault(label, []).append(run)
    return grouped


def _why_unchanged(details: Json) -> str | None:
    """A pass's own word on why it changed nothing: a ``reason``, or its ``refused`` list."""
    if isinstance(details.get("reason"), str):
        return str(details["reason"])
    refused = details.get("refused")
    if isinstance(refused, list) and refused:
        reasons = dict.fromkeys(str(r.get("reason")) for r in refused if isinstance(r, dict) and r.get("reason"))
        what = ", ".join(reasons) or "see the report"
        return f"refused {len(refused)} candidate{'s' if len(refused) > 1 else ''}: {what}"
    return None


@dataclass(frozen=True)
class Counted:
    """A count before and after: of an op type, or of a model's nodes."""

    name: str
    before: int
    after: int

    @property
    def change(self) -> int:
        return self.after - self.before


def op_rows(before: dict[str, int], after: dict[str, int]) -> list[Counted]:
    """Every op type of either histogram, the most frequent (before or after) first."""
    ops = set(before) | set(after)
    rows = [Counted(op, before.get(op, 0), after.get(op, 0)) for op in ops]
    return sorted(rows, key=lambda r: (-max(r.before, r.after), r.name))


def _fuse_details(report: Json) -> list[Json]:
    return [run["details"] for run in report["passes"] if run["pass"] == "fuse" and "error" not in run]


def fused_ops(report: Json) -> dict[str, int]:
    """Matches applied by the fuse pass over the whole run, by rule, the most first."""
    applied: Counter[str] = Counter()
    for details in _fuse_details(report):
        applied.update(details.get("applied", {}))
    return dict(sorted(applied.items(), key=lambda kv: (-kv[1], kv[0])))


@dataclass(frozen=True)
class MoreNodes:
    """A fuse rule that wrote more nodes than it removed over the run (``nodes`` more, in ``times`` rewrites), with
    its description, which says what it writes and why (``gelu-float32``: a float16 Gelu computed in float32 between
    two Casts, as onnxruntime's CPU provider has no float16 Gelu kernel)."""

    rule: str
    times: int
    nodes: int
    why: str

    def line(self) -> str:
        return (
            f"more nodes: {self.rule} x{self.times} wrote {self.nodes} more than it removed: {self.why} "
            f"(--fuse-disable {self.rule} leaves them out)"
        )


def more_nodes(report: Json) -> list[MoreNodes]:
    """The fuse rules that added nodes over the whole run (their rewrites' nodes less the ones they replaced, summed
    over the fuse executions), the most first: where the output has more nodes than it could, the report says which
    rule wrote them and why (latency beats node count)."""
    from graphopt.passes.fuse import registered_rules

    added: Counter[str] = Counter()
    for details in _fuse_details(report):
        added.update(details.get("more_nodes", {}))
    if not added:
        return []
    docs = {rule.name: rule.doc for rule in registered_rules()}
    applied = fused_ops(report)
    ranked = sorted(added.items(), key=lambda kv: (-kv[1], kv[0]))
    return [MoreNodes(rule, applied.get(rule, 0), nodes, docs.get(rule, "")) for rule, nodes in ranked]


@dataclass(frozen=True)
class NearMiss:
    """A fuse rule refused for one reason at ``sites`` places (the report keeps up to 20
    examples a family; ``sites`` counts those)."""

    what: str
    reason: str
    sites: int
    where: str


def near_misses(report: Json) -> dict[str, list[NearMiss]]:
    """The last fuse execution's near misses (the model as written), by family, each
    family's reasons with the number of places they were given at."""
    runs = _fuse_details(report)
    if not runs:
        return {}
    found: dict[str, list[NearMiss]] = {}
    for family, entry in runs[-1].get("near_misses", {}).items():
        grouped: dict[tuple[str, str], list[str]] = {}
        for example in entry.get("examples", []):
            # RunStats.miss writes "<what> at <where>: <reason>".
            what, _, rest = str(example).partition(" at ")
            where, _, reason = rest.partition(": ")
            if not reason:
                what, where, reason = "", "", str(example)
            grouped.setdefault((what, reason), []).append(where)
        found[family] = [NearMiss(what, reason, len(places), places[0]) for (what, reason), places in grouped.items()]
    return found


@dataclass(frozen=True)
class NotFused:
    """Ops the fuse pass found but could not write for the opset alone (label -> (opset it
    needs, sites)), and what to try."""

    ops: dict[str, tuple[int, int]]
    hint: str

    def line(self) -> str:
        listed = ", ".join(f"{label} x{sites}" for label, (_, sites) in self.ops.items())
        return f"not fused: {listed}: {self.hint}"


def not_fused(report: Json) -> list[NotFused]:
    """What the last fuse execution refused for the opset alone, grouped by the advice that
    fits the run's target: at ``--target onnx`` a newer ``--target-opset`` (or ``--target ort``
    where onnxruntime's own rules fuse the same op at the model's opset); at ``--target ort``
    the ops onnxruntime's rules cover are not sent to a newer standard opset (their standard
    forms are not what that target asks for: onnxruntime runs the standard Attention on CPU
    only), the others are."""
    runs = [d for d in _fuse_details(report) if "below_opset" in d]
    if not runs or not runs[-1]["below_opset"]:
        return []
    details = runs[-1]
    target, opset = details["target"], details["opset"][1]
    ranked = sorted(details["below_opset"].items(), key=lambda kv: (-kv[1]["sites"], kv[0]))
    blocked = {label: (int(entry["opset"]), int(entry["sites"])) for label, entry in ranked}
    covered = _ort_labels(opset)
    if target == "ort":
        ort = {k: v for k, v in blocked.items() if k in covered}
        standard = {k: v for k, v in blocked.items() if k not in covered}
        found = [NotFused(standard, _opset_hint(standard, ""))] if standard else []
        if ort:
            found.append(NotFused(ort, "onnxruntime's own fusions did not match (their near misses are in the report)"))
        return found
    alternative = [label for label in blocked if label in covered]
    if len(alternative) == len(blocked):
        also = " or --target ort"
    elif alternative:
        also = f"; --target ort fuses {', '.join(alternative)}"
    else:
        also = ""
    return [NotFused(blocked, _opset_hint(blocked, also))]


@dataclass(frozen=True)
class KeptSmall:
    """The constant regions the last const-cache execution left unfolded because folding them would grow the
    file past its limits (float16 weights cast to float32, a tied weight's transposed copy), and the options
    that raise them."""

    regions: int
    net_bytes: int  # the most folding them would add (a region whose prefix folded counts whole)

    def line(self, size: Callable[[int], str]) -> str:
        from graphopt.passes.constcache.pass_ import ConstCacheOptions

        defaults = ConstCacheOptions()
        regions = "1 constant region" if self.regions == 1 else f"{self.regions} constant regions"
        return (
            f"not folded for size: {regions} would grow the file by up to {size(self.net_bytes)}, past the growth "
            f"limits (--const-cache-max-growth-bytes, {size(defaults.max_growth_bytes)} a region by default; "
            f"--const-cache-max-model-growth, {defaults.max_model_growth:.0%} of the model); --defer-growth folds "
            "them once per process instead"
        )


def kept_small(report: Json) -> KeptSmall | None:
    """The growth refusals of the last const-cache execution, which saw what the run's growth budget left
    (None: there were none)."""
    runs = [run["details"] for run in report["passes"] if run["pass"] == "const-cache" and "error" not in run]
    grown = [r for r in (runs[-1].get("refused", []) if runs else []) if r.get("reason", "").startswith("net growth")]
    return KeptSmall(len(grown), sum(r["net_bytes"] for r in grown)) if grown else None


def left_undone(report: Json, size: Callable[[int], str]) -> list[str]:
    """One line per thing the run left undone that an option would do: the ops not fused for the opset alone
    (:func:`not_fused`), then the constants not folded for size (:func:`kept_small`)."""
    unfolded = kept_small(report)
    return [group.line() for group in not_fused(report)] + ([unfolded.line(size)] if unfolded is not None else [])


def _opset_hint(blocked: dict[str, tuple[int, int]], also: str) -> str:
    needed = list(dict.fromkeys(opset for opset, _ in blocked.values()))
    return f"need opset {' / '.join(map(str, needed))} (try --target-opset {max(needed)}{also})"


def _ort_labels(opset: int) -> set[str]:
    """What onnxruntime's own default rules (``--target ort`` only) fuse at ``opset``."""
    from graphopt.passes.fuse import registered_rules

    return {r.what for r in registered_rules() if r.default and "onnx" not in r.targets and r.min_opset <= opset}


def criterion(numerics: Json) -> str | None:
    """The criterion a check judged by, as its report names it: how it passed (``passed_by``),
    else the kind of its criterion."""
    if isinstance(numerics.get("passed_by"), str):
        return str(numerics["passed_by"])
    found = numerics.get("criterion")
    return str(found["kind"]) if isinstance(found, dict) and found.get("kind") else None


def verdict(output: Json) -> str:
    """An output's verdict: passed (with the criterion it passed by, when the report says), failed or not checked."""
    if output["passed"] is None:
        return "not checked"
    if output["passed"] is False:
        return "failed"
    return "passed" + (f" ({output['criterion']})" if isinstance(output.get("criterion"), str) else "")
