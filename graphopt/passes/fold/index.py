"""The fold index and ``build_folded_graph``: the seed's folding algorithm over any graph.

Level by level (the layer-wise topological order), a grouping function splits the nodes of
one level into groups of nodes with equal fold keys, and every group becomes one fold. The
:class:`FoldIndex` maps every output of a folded node to its :class:`Slot`, the pair
(fold id, slice) that locates it in the fold's output; each fold records, per member and
per input, the slot that input comes from (the seed's ``in_fold_idx``), so the next level
reads its inputs through the index rather than through the unfolded nodes.

The algorithm knows nothing about ONNX: the grouping function decides what may fold, and
the caller decides how a fold is realized.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from graphopt.ir import Node, Value

__all__ = ["Fold", "FoldIndex", "Slot", "build_folded_graph"]

Spec = TypeVar("Spec")


@dataclass(frozen=True)
class Slot:
    """Where an original output lives: member ``slice`` of fold ``fold``."""

    fold: int
    slice: int


@dataclass
class Fold(Generic[Spec]):
    """One group of same-level nodes computed as one op. ``inputs[i][j]`` is the slot input
    ``j`` of member ``i`` reads (None: a value outside every fold); ``spec`` is what the
    grouping function found out about the group (how it would be realized)."""

    id: int
    members: list[Node]
    spec: Spec
    inputs: list[list[Slot | None]] = field(default_factory=list)


@dataclass
class FoldIndex(Generic[Spec]):
    folds: list[Fold[Spec]] = field(default_factory=list)
    slots: dict[Value, Slot] = field(default_factory=dict)

    def slot(self, value: Value | None) -> Slot | None:
        return None if value is None else self.slots.get(value)

    def sources(self, fold: Fold[Spec], position: int) -> list[Slot | None]:
        """The slots input ``position`` of each member reads."""
        return [member[position] for member in fold.inputs]


# A group found in one level: its members (in fold order) and its spec.
Group = tuple[list[Node], Spec]
GroupFn = Callable[[Sequence[Node], FoldIndex[Spec]], Iterable[Group[Spec]]]


def build_folded_graph(levels: Iterable[Sequence[Node]], group_fn: GroupFn[Spec]) -> FoldIndex[Spec]:
    """Fold each level's groups (the seed's ``build_folded_graph``), in level order, so a
    group's inputs are found in the index as folds of earlier levels."""
    index: FoldIndex[Spec] = FoldIndex()
    for level in levels:
        for members, spec in group_fn(level, index):
            fold = Fold(len(index.folds), list(members), spec)
            fold.inputs = [[index.slot(v) for v in member.inputs] for member in fold.members]
            for position, member in enumerate(fold.members):
                for output in member.outputs:
                    index.slots[output] = Slot(fold.id, position)
            index.folds.append(fold)
    return index


def group_by_key(nodes: Iterable[Node], key: Callable[[Node], Hashable | None]) -> list[list[Node]]:
    """The seed's ``group_foldable_modules``: nodes with equal keys, in first-seen order;
    a node whose key is None folds with nothing."""
    groups: dict[Hashable, list[Node]] = {}
    for node in nodes:
        found = key(node)
        if found is not None:
            groups.setdefault(found, []).append(node)
    return list(groups.values())
