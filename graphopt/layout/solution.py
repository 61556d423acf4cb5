"""A solved layout problem: each sink's layout, run-length compressed, and how good it is.

A sink element's mapping is named ``(tensor, index)``: the element of a source, fixed
point or barrier output whose mapping it takes, or, for a fresh mapping, a sink element
that carries it (the first one, row-major in problem order), flagged ``fresh``. Runs
compress consecutive elements whose indices advance by a constant step, so a sink that
is a source unwound through a DimShuffle or a Reverse takes a few runs, not one an element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from graphopt.layout.problem import SINK, Problem

__all__ = ["Run", "Solution", "normalized"]


@dataclass(frozen=True)
class Run:
    """Sink elements ``at .. at + count - 1`` (row-major) take the mappings of ``source``'s
    elements ``index, index + step, ...``."""

    at: int
    count: int
    source: str
    index: int
    step: int
    fresh: bool

    def as_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"at": self.at, "count": self.count, "source": self.source, "index": self.index}
        entry["step"] = self.step
        if self.fresh:
            entry["fresh"] = True
        return entry


@dataclass
class Solution:
    problem: Problem
    labels: np.ndarray
    objective: float
    solver: str
    seconds: float
    exact: bool

    @property
    def upper_bound(self) -> float:
        return self.problem.upper_bound

    def mappings(self, sink: str) -> list[tuple[str, int]]:
        """``(tensor, index)`` of each element of ``sink``, row-major."""
        slots = self.problem.ref[sink].ravel()
        return [self.problem.slot_origin(int(label)) for label in self.labels[slots]]

    def layout(self, sink: str) -> list[Run]:
        kinds = self.problem.slot_kinds()
        slots = self.problem.ref[sink].ravel()
        runs: list[Run] = []
        for at, slot in enumerate(slots.tolist()):
            label = int(self.labels[slot])
            source, index = self.problem.slot_origin(label)
            if runs:
                last = runs[-1]
                step = index - last.index if last.count == 1 else last.step
                if last.source == source and index == last.index + last.count * step:
                    runs[-1] = Run(last.at, last.count + 1, source, last.index, step, last.fresh)
                    continue
            runs.append(Run(at, 1, source, index, 1, bool(kinds[label] == SINK)))
        return runs

    def as_dict(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "seconds": round(self.seconds, 6),
            "objective": self.objective,
            "upper_bound": self.upper_bound,
            "exact": self.exact,
            "layouts": {sink: [run.as_dict() for run in self.layout(sink)] for sink in self.problem.sinks},
        }


def normalized(problem: Problem, labels: np.ndarray) -> np.ndarray:
    """``labels`` with every fresh mapping named after the first sink slot that carries it, so
    a solution names only mappings that exist; unassigned sink slots keep their own."""
    kinds = problem.slot_kinds()
    result = labels.copy()
    sink_slots = np.nonzero(kinds == SINK)[0]
    fresh = sink_slots[kinds[labels[sink_slots]] == SINK]
    first: dict[int, int] = {}
    for slot in fresh.tolist():
        first.setdefault(int(labels[slot]), slot)
    for slot in fresh.tolist():
        result[slot] = first[int(labels[slot])]
    return result
