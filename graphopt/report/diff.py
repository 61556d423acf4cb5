"""What `graphopt diff A B` shows: two inspections (report/inspection.py) side by side.

Every figure is a pair ``[a, b]``, as a report's totals are ``[before, after]``.
"""

from __future__ import annotations

from typing import Any

from graphopt.report.views import op_rows

__all__ = ["diff_inspections"]

Json = dict[str, Any]


def diff_inspections(a: Json, b: Json) -> Json:
    """The difference of two models' inspections: signatures (a side is None where the
    model lacks that input or output), op histograms with their change, the ops B has more
    of than A (what fusing made), sizes and opsets."""
    rows = op_rows(a["ops"], b["ops"])
    ops = [{"op": r.name, "a": r.before, "b": r.after, "change": r.change} for r in rows]
    domains = list(dict.fromkeys([*a["opsets"], *b["opsets"]]))
    return {
        "a": a["path"],
        "b": b["path"],
        "inputs": _signature(a["inputs"], b["inputs"]),
        "outputs": _signature(a["outputs"], b["outputs"]),
        "nodes": [a["nodes"], b["nodes"]],
        "ops": ops,
        "fused": {r.name: r.change for r in rows if r.change > 0},
        **{key: [a[key], b[key]] for key in _PAIRED},
        "opsets": {domain: [a["opsets"].get(domain), b["opsets"].get(domain)] for domain in domains},
    }


# The figures of an inspection compared as they are.
_PAIRED = ("initializers", "parameters", "parameter_bytes", "file_bytes", "ir_version", "producer")


def _signature(a: list[Json], b: list[Json]) -> list[Json]:
    """Inputs (or outputs) by name, in A's order then B's: each with its type in A and in B."""
    types_a = {entry["name"]: entry["type"] for entry in a}
    types_b = {entry["name"]: entry["type"] for entry in b}
    names = list(dict.fromkeys([*types_a, *types_b]))
    return [{"name": name, "a": types_a.get(name), "b": types_b.get(name)} for name in names]
