"""Solvers for layout problems: the seed's greedy baseline, and the default.

``greedy`` (the seed's baseline): take the pairs by descending value; when one side of a
pair is complete (every element has a mapping) and the other side unwinds to sink
elements that are still free, give those the complete side's mappings, then start again
from the most valuable pair. A barrier's outputs get their mappings only once all its
inputs are complete. It stops when no pair can progress; untouched sink elements keep
fresh mappings.

``default`` works on the objective directly. Each pair element compares two slots (see
:mod:`problem`), so the objective is a constant plus, per sink slot, a *unary* gain for
each fixed mapping it may copy, plus a *pairwise* gain for each other sink slot it may
agree with. Sink slots linked by pairwise gains form components that are solved apart:

1. start from greedy's answer and, separately, from a look-ahead construction (slots by
   decreasing best gain, each taking the mapping worth most given its decided
   neighbours);
2. improve both by local search: re-pick one slot's mapping, or move a whole region (all
   sink slots one side of a pair unwinds to) onto the other side's mappings, keeping a
   move only when the objective rises;
3. on components of at most :data:`EXACT_SLOTS` slots, branch and bound over each
   slot's candidates (the fixed mappings seen in its component, and one fresh mapping
   the component's slots may share: with values >= 0 nothing else can score more),
   pruned with the upper bound of what the undecided slots could still add.

Every step keeps the best answer so far, and the greedy answer is one of the starts, so
the default never scores below greedy. ``exact`` is true when every component was
settled by a finished branch and bound.

Both honour their time budget: every loop reads the clock, and when the budget is spent
the solver answers with what it has (greedy: the slots it gave mappings so far, the
others fresh; the default: its best answer so far, or greedy's).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Literal

import numpy as np

from graphopt.layout.problem import FIXED, SINK, Problem
from graphopt.layout.solution import Solution, normalized

__all__ = ["DEFAULT_TIME_BUDGET", "EXACT_SLOTS", "SOLVERS", "SolverName", "solve", "solve_default", "solve_greedy"]

DEFAULT_TIME_BUDGET = 10.0
# Branch and bound runs on components of at most this many sink slots ...
EXACT_SLOTS = 64
# ... and gives up (keeping the best answer found) after this many search nodes.
NODE_LIMIT = 200_000
_EPS = 1e-9
# The loops over many cheap steps read the clock once in this many.
_CLOCK_EVERY = 4096


class _OutOfTime(Exception):
    """The budget ran out while the default solver set up a step: it answers with greedy's."""


def _spent(deadline: float) -> bool:
    return time.perf_counter() >= deadline


def solve(problem: Problem, solver: SolverName = "default", time_budget: float = DEFAULT_TIME_BUDGET) -> Solution:
    start = time.perf_counter()
    labels, exact = SOLVERS[solver](problem, time_budget)
    labels = normalized(problem, labels)
    return Solution(problem, labels, problem.objective(labels), solver, time.perf_counter() - start, exact)


# -- greedy ------------------------------------------------------------------------------


def solve_greedy(problem: Problem, time_budget: float = DEFAULT_TIME_BUDGET) -> tuple[np.ndarray, bool]:
    deadline = time.perf_counter() + time_budget
    kinds = problem.slot_kinds()
    labels = np.arange(problem.slot_count, dtype=np.int64)
    known = kinds == FIXED
    for origin in problem.gates:
        known[problem.ref[origin]] = False
    aliases = problem.alias_targets()
    pending_gates = dict(problem.gates)
    complete: set[str] = set()

    def is_complete(tensor: str) -> bool:
        if tensor not in complete and bool(known[problem.ref[tensor]].all()):
            complete.add(tensor)
        return tensor in complete

    def open_gates() -> None:
        opened = True
        while opened and not _spent(deadline):
            opened = False
            for origin, ins in list(pending_gates.items()):
                if all(is_complete(x) for x in ins):
                    del pending_gates[origin]
                    slots = problem.ref[origin].ravel()
                    for slot in slots.tolist():
                        if slot in aliases:
                            labels[slot] = labels[aliases[slot]]
                    known[slots] = True
                    opened = True

    def unwind(target: str, given: str) -> bool:
        """Give the free sink slots ``target`` unwinds to the mappings of ``given``."""
        slots = problem.ref[target].ravel()
        free = np.nonzero((kinds[slots] == SINK) & ~known[slots])[0]
        if not len(free):
            return False
        chosen, first = np.unique(slots[free], return_index=True)
        labels[chosen] = labels[problem.ref[given].ravel()[free[first]]]
        known[chosen] = True
        return True

    open_gates()
    active = sorted(range(len(problem.pairs)), key=lambda i: -problem.pairs[i].value)
    progressed = True
    while progressed:
        progressed = False
        kept: list[int] = []
        for position, i in enumerate(active):
            if _spent(deadline):
                return labels, False
            pair = problem.pairs[i]
            a_done, b_done = is_complete(pair.a), is_complete(pair.b)
            if a_done and b_done:
                continue
            if (a_done and unwind(pair.b, pair.a)) or (b_done and unwind(pair.a, pair.b)):
                open_gates()
                kept.extend(active[position:])
                progressed = True
                break
            kept.append(i)
        active = kept
    return labels, False


# -- the default -------------------------------------------------------------------------------


class _Terms:
    """The objective as unary and pairwise gains of sink slots (see the module docstring)."""

    def __init__(self, problem: Problem, deadline: float) -> None:
        self.problem = problem
        self.deadline = deadline
        n = problem.slot_count
        kinds = problem.slot_kinds()
        lookup = np.arange(n, dtype=np.int64)
        for alias, target in problem.alias_targets().items():
            lookup[alias] = target
        self.lookup = lookup
        firsts, seconds, weights = [], [], []
        for pair in problem.pairs:
            a = lookup[problem.ref[pair.a].ravel()]
            b = lookup[problem.ref[pair.b].ravel()]
            differ = a != b
            firsts.append(np.minimum(a, b)[differ])
            seconds.append(np.maximum(a, b)[differ])
            weights.append(np.full(int(differ.sum()), pair.value))
        self.unary: dict[int, dict[int, float]] = defaultdict(dict)
        self.neighbours: dict[int, dict[int, float]] = defaultdict(dict)
        if firsts:
            u, v, w = np.concatenate(firsts), np.concatenate(seconds), np.concatenate(weights)
            keys, inverse = np.unique(u * n + v, return_inverse=True)
            totals = np.bincount(inverse, weights=w)
            for count, (key, total) in enumerate(zip(keys.tolist(), totals.tolist())):
                if count % _CLOCK_EVERY == 0 and _spent(deadline):
                    raise _OutOfTime
                if total <= 0:
                    continue
                x, y = divmod(key, n)
                x_sink, y_sink = kinds[x] == SINK, kinds[y] == SINK
                if x_sink and y_sink:
                    self.neighbours[x][y] = total
                    self.neighbours[y][x] = total
                elif x_sink:
                    self.unary[x][y] = self.unary[x].get(y, 0.0) + total
                elif y_sink:
                    self.unary[y][x] = self.unary[y].get(x, 0.0) + total
        self.slots = sorted(set(self.unary) | set(self.neighbours))
        # The barrier outputs each sink slot may not copy (they depend on it).
        self._forbidden_origins = {
            slot: problem.forbidden.get(problem.slot_origin(slot)[0], set()) for slot in self.slots
        }

    def allowed(self, slot: int, label: int) -> bool:
        forbidden = self._forbidden_origins.get(slot)
        return not forbidden or self.problem.slot_origin(label)[0] not in forbidden

    def gain(self, slot: int, label: int, labels: np.ndarray) -> float:
        total = self.unary[slot].get(label, 0.0) if slot in self.unary else 0.0
        for other, weight in self.neighbours.get(slot, {}).items():
            if labels[other] == label:
                total += weight
        return total

    def candidates(self, slot: int, labels: np.ndarray) -> set[int]:
        found = set(self.unary.get(slot, {}))
        found.update(int(labels[t]) for t in self.neighbours.get(slot, {}))
        found.add(int(labels[slot]))
        return {label for label in found if self.allowed(slot, label)}

    def components(self) -> list[list[int]]:
        parent = {s: s for s in self.slots}

        def root(s: int) -> int:
            while parent[s] != s:
                parent[s] = parent[parent[s]]
                s = parent[s]
            return s

        for count, (s, others) in enumerate(self.neighbours.items()):
            if count % _CLOCK_EVERY == 0 and _spent(self.deadline):
                raise _OutOfTime
            for t in others:
                rs, rt = root(s), root(t)
                if rs != rt:
                    parent[max(rs, rt)] = min(rs, rt)
        groups: dict[int, list[int]] = defaultdict(list)
        for s in self.slots:
            groups[root(s)].append(s)
        return list(groups.values())

    def score(self, slots: list[int], labels: np.ndarray) -> float:
        inside = set(slots)
        total = 0.0
        for s in slots:
            total += self.unary[s].get(int(labels[s]), 0.0) if s in self.unary else 0.0
            for t, weight in self.neighbours.get(s, {}).items():
                if t in inside and t > s and labels[t] == labels[s]:
                    total += weight
        return total

    def change(self, moves: dict[int, int], labels: np.ndarray) -> float:
        """How much the objective rises if each slot in ``moves`` takes its new label."""
        delta = 0.0
        for s, new in moves.items():
            old = int(labels[s])
            unary = self.unary.get(s, {})
            delta += unary.get(new, 0.0) - unary.get(old, 0.0)
            for t, weight in self.neighbours.get(s, {}).items():
                if t in moves and t < s:
                    continue
                t_old = int(labels[t])
                t_new = moves.get(t, t_old)
                delta += weight * ((t_new == new) - (t_old == old))
        return delta


def solve_default(problem: Problem, time_budget: float = DEFAULT_TIME_BUDGET) -> tuple[np.ndarray, bool]:
    deadline = time.perf_counter() + time_budget
    greedy_labels, _ = solve_greedy(problem, time_budget)
    try:
        terms = _Terms(problem, deadline)
        components = terms.components()
    except _OutOfTime:
        return greedy_labels, False
    from_greedy = greedy_labels.copy()
    _local_search(terms, from_greedy, deadline)
    ahead = _look_ahead(terms, greedy_labels, deadline)
    _local_search(terms, ahead, deadline)
    labels = greedy_labels.copy()
    exact = True
    for component in components:
        if _spent(deadline):  # the components not reached keep greedy's answer
            exact = False
            break
        best = max((from_greedy, ahead, greedy_labels), key=lambda lab: terms.score(component, lab))
        labels[component] = best[component]
        if len(component) <= EXACT_SLOTS and not _spent(deadline):
            exact &= _branch_and_bound(terms, component, labels, deadline)
        else:
            exact = False
    if problem.objective(labels) < problem.objective(greedy_labels) - _EPS:  # float ties only
        return greedy_labels, False
    return labels, exact


def _look_ahead(terms: _Terms, start: np.ndarray, deadline: float) -> np.ndarray:
    """Decide slots by decreasing best unary gain, each the label worth most given the
    slots decided before it (until the deadline: the others keep ``start``'s label)."""
    labels = start.copy()
    decided: set[int] = set()

    def best_unary(slot: int) -> float:
        return max(terms.unary.get(slot, {}).values(), default=0.0)

    for slot in sorted(terms.slots, key=lambda s: (-best_unary(s), s)):
        if _spent(deadline):
            break
        unary = terms.unary.get(slot, {})
        neighbours = terms.neighbours.get(slot, {})
        options = set(unary) | {int(labels[t]) for t in neighbours if t in decided}
        best: tuple[float, int] | None = None
        for label in sorted(option for option in options if terms.allowed(slot, option)):
            worth = unary.get(label, 0.0) + sum(w for t, w in neighbours.items() if t in decided and labels[t] == label)
            if best is None or worth > best[0] + _EPS:
                best = (worth, label)
        if best is not None:
            labels[slot] = best[1]
        decided.add(slot)
    return labels


def _local_search(terms: _Terms, labels: np.ndarray, deadline: float) -> None:
    """Single-slot and region moves, each kept only if the objective rises, until none does."""
    problem = terms.problem
    regions: list[list[tuple[int, int]]] = []
    kinds = problem.slot_kinds()
    for pair in sorted(problem.pairs, key=lambda p: -p.value):
        for target, given in ((pair.a, pair.b), (pair.b, pair.a)):
            slots = terms.lookup[problem.ref[target].ravel()]
            sources = terms.lookup[problem.ref[given].ravel()]
            if _spent(deadline):
                return
            sink = kinds[slots] == SINK
            if sink.any():
                regions.append(list(zip(slots[sink].tolist(), sources[sink].tolist())))
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for slot in terms.slots:
            if _spent(deadline):
                return
            current = terms.gain(slot, int(labels[slot]), labels)
            for label in sorted(terms.candidates(slot, labels)):
                if terms.gain(slot, label, labels) > current + _EPS:
                    labels[slot] = label
                    current = terms.gain(slot, label, labels)
                    improved = True
        for region in regions:
            if time.perf_counter() >= deadline:
                return
            moves: dict[int, int] = {}
            for slot, source in region:
                label = int(labels[source])
                if slot not in moves and terms.allowed(slot, label):
                    moves[slot] = label
            if moves and terms.change(moves, labels) > _EPS:
                for slot, label in moves.items():
                    labels[slot] = label
                improved = True


def _branch_and_bound(terms: _Terms, component: list[int], labels: np.ndarray, deadline: float) -> bool:
    """Search the component's assignments exhaustively (pruned); write the best into
    ``labels``. True when the search finished, so the answer is optimal."""
    # Order: breadth first from the most connected slot, so neighbours are decided early.
    inside = set(component)
    order: list[int] = []
    seen: set[int] = set()
    for root in sorted(component, key=lambda s: (-len(terms.neighbours.get(s, {})), s)):
        if root in seen:
            continue
        seen.add(root)
        queue = [root]
        while queue:
            s = queue.pop(0)
            order.append(s)
            for t in sorted(terms.neighbours.get(s, {})):
                if t in inside and t not in seen:
                    seen.add(t)
                    queue.append(t)
    position = {s: k for k, s in enumerate(order)}
    fresh = min(component)
    fixed_labels = sorted({label for s in component for label in terms.unary.get(s, {})})
    domains = [[label for label in fixed_labels if terms.allowed(s, label)] + [fresh] for s in order]
    earlier = [
        [(position[t], w) for t, w in terms.neighbours.get(s, {}).items() if position[t] < k]
        for k, s in enumerate(order)
    ]
    unaries = [terms.unary.get(s, {}) for s in order]
    size = len(order)
    rest = [0.0] * (size + 1)
    for k in range(size - 1, -1, -1):
        rest[k] = rest[k + 1] + max(unaries[k].values(), default=0.0) + sum(w for _, w in earlier[k])
    best = [terms.score(component, labels)]
    best_assignment = [int(labels[s]) for s in order]
    assignment = [0] * size
    nodes = [0]
    finished = [True]
    check: Callable[[], bool] = lambda: time.perf_counter() < deadline  # noqa: E731

    def search(k: int, value: float) -> None:
        if not finished[0]:
            return
        nodes[0] += 1
        if nodes[0] > NODE_LIMIT or (nodes[0] % 1024 == 0 and not check()):
            finished[0] = False
            return
        if value + rest[k] <= best[0] + _EPS:
            return
        if k == size:
            best[0] = value
            best_assignment[:] = assignment
            return
        gains = []
        for label in domains[k]:
            gain = unaries[k].get(label, 0.0)
            for j, weight in earlier[k]:
                if assignment[j] == label:
                    gain += weight
            gains.append((gain, label))
        gains.sort(key=lambda item: -item[0])
        for gain, label in gains:
            assignment[k] = label
            search(k + 1, value + gain)

    search(0, 0.0)
    for s, label in zip(order, best_assignment):
        labels[s] = label
    return finished[0]


SolverName = Literal["default", "greedy"]
SOLVERS: dict[SolverName, Callable[[Problem, float], tuple[np.ndarray, bool]]] = {
    "greedy": solve_greedy,
    "default": solve_default,
}
