"""The ``fuse`` pass: shatter rules, then fuse rules, round after round (engine.py).

It runs the built-in :data:`~graphopt.passes.fuse.rules.LIBRARY` followed by the rules users
add with :func:`add_rule`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from graphopt.errors import InputError
from graphopt.ir import CONTRIB_DOMAIN, Graph, Model
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.fuse.rules import LIBRARY
from graphopt.passes.fuse.rules.lower import FAMILY as LOWERING
from graphopt.passes.rewrite.engine import Rule, RuleSet, RunStats, Site, run_round

__all__ = ["Fuse", "add_rule", "registered_rules", "remove_rule", "select_rules"]

# The rules users added (add_rule), run after the library's.
_USER: list[Rule[Any]] = []


def add_rule(rule: Rule[Any], *, replace: bool = False) -> Rule[Any]:
    """Add ``rule`` to the user rules the fuse pass runs; returns it.

    Adding the same rule again changes nothing, and a rule named like an earlier user rule
    replaces it (so a re-run notebook cell does not fail). A library rule's name is refused
    unless ``replace``: then the user rule takes the library rule's place.
    """
    if rule in _USER:
        return rule
    if not replace and any(r.name == rule.name for r in LIBRARY):
        raise ValueError(f"a fuse rule named {rule.name!r} is already in the library (add it with replace=True)")
    remove_rule(rule.name)
    _USER.append(rule)
    return rule


def remove_rule(name: str) -> None:
    """Drop the user rule named ``name`` (nothing when there is none)."""
    _USER[:] = [r for r in _USER if r.name != name]


def registered_rules() -> list[Rule[Any]]:
    """The rules the fuse pass knows, in priority order: the library's (a user rule added with
    ``replace`` in its place), then the user's."""
    mine = {r.name: r for r in _USER}
    library = [mine.pop(r.name, r) for r in LIBRARY]
    return [*library, *mine.values()]


def select_rules(names_on: Iterable[str], names_off: Iterable[str], target: str) -> RuleSet:
    """The rules a run uses: the defaults plus ``names_on``, minus ``names_off``, for ``target``."""
    known = registered_rules()
    names = {r.name for r in known} | {r.family for r in known}
    on, off = set(names_on), set(names_off)
    for name in on | off:
        if name not in names:
            raise InputError(f"fuse: unknown rule or family {name!r}; see `graphopt passes fuse`")
    return RuleSet(
        rule
        for rule in known
        if (rule.default or rule.name in on or rule.family in on)
        and rule.name not in off
        and rule.family not in off
        and target in rule.targets
    )


# The output's metadata key saying that the check refused this model's fusions through Q/DQ
# (runner.py), all of them ("off: ...") or those of some families ("off for norm: ..."): a run
# on it keeps those pairs, as the run that wrote it did.
QDQ_PAIRS_KEPT = "graphopt.fuse_through_qdq"
_OFF, _OFF_FOR = "off", "off for "


def keep_qdq_pairs(model: Model, families: Iterable[str] | None = None) -> None:
    """Mark ``model`` so that fuse matches nothing through its Q/DQ pairs, or only the rules of
    other families than ``families`` do (the report says why)."""
    if families is None:
        model.metadata_props[QDQ_PAIRS_KEPT] = f"{_OFF}: the check refused it"
    else:
        model.metadata_props[QDQ_PAIRS_KEPT] = f"{_OFF_FOR}{', '.join(sorted(families))}: the check refused them"


def _withheld(model: Model) -> frozenset[str] | None:
    """The families whose rules ``model``'s mark keeps from matching through Q/DQ pairs; None:
    every family's (keep_qdq_pairs)."""
    mark = model.metadata_props.get(QDQ_PAIRS_KEPT)
    if mark is None:
        return frozenset()
    if mark.startswith(_OFF_FOR):
        return frozenset(name.strip() for name in mark[len(_OFF_FOR) :].partition(":")[0].split(","))
    return None


def families_fused_through_qdq(applied: Mapping[str, int]) -> Counter[str]:
    """The rewrites through Q/DQ pairs per rule family, from a fuse run's ``through_qdq``
    detail (the rewrites per rule)."""
    family = {rule.name: rule.family for rule in registered_rules()}
    found: Counter[str] = Counter()
    for name, count in applied.items():
        found[family.get(name, name)] += count
    return found


@dataclass
class FuseOptions:
    max_rounds: int = option(5, "most rounds of shatter then fuse rules per run")
    enable: list[str] = option([], "rules or families to run that are off by default")
    disable: list[str] = option([], "rules or families not to run")
    through_qdq: bool = option(
        True,
        "match the float fusions (activation, attention, norm, rotary) through a static QDQ model's activation "
        "Q/DQ pairs, which the fused op drops: it reads the dequantized inputs and its result is quantized again "
        "with the original's scale and zero point; where the check refuses that, the run optimizes again without "
        "one more rule family's fusions through the pairs at a time (keeping withheld the family that came nearest "
        "where none is enough), then without any, and marks the output so "
        "(metadata graphopt.fuse_through_qdq) (off: every quantization point of the original stays)",
    )
    late: bool = option(
        False,
        "also run the late rules, once the others change nothing, or in one more round after max_rounds "
        "(on in the default pipeline's settle group)",
    )


@register
class Fuse(Pass, name="fuse", options=FuseOptions):
    """Fuse op patterns into fused ops (LayerNorm, GELU, attention, Conv+BN, ...) and shatter what hides folding"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        options: FuseOptions = self.options
        target = ctx.settings.target
        opset_before = model.opset
        goal = ctx.settings.target_opset or model.opset
        if goal > model.opset:
            ctx.convert_opset(model, goal)  # upgrade first, so the newer fused ops become available
        rules = select_rules(options.enable, options.disable, target)
        shatter = RuleSet(r for r in rules if r.kind == "shatter")
        fuse = RuleSet(r for r in rules if r.kind == "fuse")
        late = [r for r in rules if r.kind == "late" and options.late]
        stats = RunStats()
        marked = _withheld(model)
        through_qdq = options.through_qdq and marked is not None
        withheld = marked or frozenset()

        def site_for(graph: Graph) -> Site:
            return Site(model, graph, min(model.opset_in(graph), goal), target, ctx)

        rounds = 0
        pending, late_ran = bool(late), not late
        # The rules that joined after a round that chose no match: on that same graph the others choose
        # none again, so the round after it tries only these (the others again where they change it).
        joined: RuleSet | None = None
        for _ in range(options.max_rounds):
            rounds += 1
            chosen = stats.chosen
            changed = 0 if joined is not None else run_round(model, shatter, site_for, stats)
            changed += run_round(model, fuse, site_for, stats, through_qdq=through_qdq, withheld=withheld, only=joined)
            late_ran = late_ran or not pending
            joined = None
            if changed == 0:
                if not pending:
                    break
                # The late rules join once the others change nothing (they would take their nodes).
                fuse, pending = fuse + late, False
                joined = RuleSet(late) if stats.chosen == chosen else None
        if not late_ran:  # no round was left for them: one more, after the others
            rounds += 1
            run_round(model, RuleSet(late), site_for, stats, through_qdq=through_qdq, withheld=withheld)
        if CONTRIB_DOMAIN not in model.opset_imports and any(n.domain == CONTRIB_DOMAIN for n in model.all_nodes()):
            model.opset_imports[CONTRIB_DOMAIN] = 1
        if goal < model.opset:
            try:
                ctx.convert_opset(model, goal)  # after the shatter rules lowered the ops the goal lacks
            except InputError as err:
                why = stats.near_misses.get(LOWERING, [])  # the op that blocks it, and why it stayed
                raise InputError(f"{err}; not lowered: {'; '.join(why[:3])}" if why else str(err)) from None
        changed = bool(stats.applied) or model.opset != opset_before
        details = {"target": target, "opset": [opset_before, model.opset], "rounds": rounds, **stats.as_dict()}
        return PassResult(changed, details, stats.failures)
