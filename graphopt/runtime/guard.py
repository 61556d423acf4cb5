"""The runtime guard: the output never costs onnxruntime a fusion the original got.

After the pipeline, onnxruntime loads the original and the output at ORT_ENABLE_ALL and a
census counts the fused kernels of each runtime graph (census.py): a session load each, no
timing. When the output has fewer of a kind, the rewrites that applied are bisected to find
the one that cost it, and it is undone: the pipeline reruns from the original without it.

What can be undone (:class:`Undoable`) is read off the pipeline's record: each fuse rule
that applied (left out through the fuse pass's ``disable`` option), and each other pass
that changed the model (left out of the pipeline), shape inference aside: stripping the
value_info shape inference wrote can cost onnxruntime a SkipLayerNormalization, which reads
the shapes of the residual sum. Leaving out the first k of the n that
applied, in the order they first applied, keeps the kind at k = n (else no rewrite is to
blame, and the loss is reported as it is) and loses it at k = 0, so a bisection finds the
smallest k that keeps it in log2(n) reruns: the k-th is the culprit. The pipeline then
reruns without it alone; a kind still lost (two rewrites that each cost it) starts another
search with the culprits found left out, at most :data:`MAX_UNDONE` times. A culprit whose
undoing costs a fusion the output has (a MultiHeadAttention graphopt wrote, undone for one
SkipLayerNormalization) is spared, and the search goes on without it; at the end each
rewrite undone is put back if the others suffice.

The census cannot see a kernel that is kept but slower (a MultiHeadAttention with a 4-D
bias where onnxruntime formed no attention kernel at all): timing is ``--tune``'s work.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.ir import Model
from graphopt.ir.clone import Snapshot
from graphopt.passes.base import Pass
from graphopt.passes.pipeline import Group, PassRun, Pipeline, PipelineRun, Step, default_pipeline
from graphopt.runtime.census import Census, Loss, census_of_file, losses

__all__ = ["MAX_UNDONE", "GuardOutcome", "RuntimeGuard", "Undoable", "guards", "undoable", "without"]

logger = logging.getLogger(__name__)

# Most rewrites undone for one model: each costs a bisection (log2 of the rewrites applied).
MAX_UNDONE = 4
# Passes never undone: the passes after shape inference read the types it gives.
_KEPT = frozenset({"shape-infer"})
# The pass whose rules are undone one by one (its ``disable`` option); other passes go whole.
_RULE_PASS = "fuse"


@dataclass(frozen=True)
class Undoable:
    """A rewrite the guard can undo: one rule of the fuse pass, or a whole pass."""

    pass_name: str
    rule: str | None = None

    def describe(self) -> str:
        return f"the rule {self.rule}" if self.rule is not None else f"the pass {self.pass_name}"

    def as_dict(self) -> dict[str, str]:
        return {"pass": self.pass_name, **({"rule": self.rule} if self.rule is not None else {})}


def undoable(runs: Sequence[PassRun]) -> list[Undoable]:
    """The rewrites that applied in ``runs``, in the order they first applied."""
    from graphopt.passes.fuse import registered_rules
    from graphopt.passes.fuse.rules.lower import FAMILY as LOWERING

    # The lowering rules take the model to the target opset: without them it cannot get there.
    lowering = {rule.name for rule in registered_rules() if rule.family == LOWERING}
    found: dict[Undoable, None] = {}
    for run in runs:
        if run.name == _RULE_PASS:
            rules = [rule for rule in run.details.get("applied", {}) if rule not in lowering]
            found.update((Undoable(run.name, rule), None) for rule in rules)
        elif run.name not in _KEPT and run.error is None and run.changed:
            found[Undoable(run.name)] = None
    return list(found)


def without(pipeline: Pipeline, undone: Iterable[Undoable]) -> Pipeline:
    """A copy of ``pipeline`` that leaves out ``undone``: fuse rules disabled on every fuse
    step, passes dropped (a group left with no step goes too)."""
    undone = list(undone)
    rules = [u.rule for u in undone if u.rule is not None]
    passes = {u.pass_name for u in undone if u.rule is None}

    def kept(steps: Sequence[Step]) -> list[Step]:
        found: list[Step] = []
        for step in steps:
            if isinstance(step, Group):
                inner = kept(step.steps)
                if inner:
                    found.append(dataclasses.replace(step, steps=inner))
            elif step.name not in passes:
                found.append(_disabling(step, rules) if step.name == _RULE_PASS and rules else step)
        return found

    return dataclasses.replace(pipeline, steps=kept(pipeline.steps))


def _disabling(step: Pass, rules: list[str]) -> Pass:
    disabled = [*step.options.disable, *(r for r in rules if r not in step.options.disable)]
    return type(step)(dataclasses.replace(step.options, disable=disabled))


def guards(pipeline: Pipeline) -> bool:
    """Whether a run of ``pipeline`` is guarded by default: the default pipeline's passes (its
    options as the run's knobs set them), at either target."""
    return pipeline.pass_names() == default_pipeline().pass_names()


@dataclass
class Trial:
    """The pipeline rerun without some rewrites: its model, its record and what it lost."""

    model: Model
    run: PipelineRun
    census: Census | None
    losses: list[Loss]


@dataclass
class GuardOutcome:
    """What the guard did: ``status`` is "kept" (no fusion lost), "undone" (rewrites undone:
    ``model``, ``run`` and ``pipeline`` are the rerun's), "lost" (a loss no rewrite explains)
    or "not taken" (``reason``: onnxruntime could not load a model)."""

    status: str
    pipeline: Pipeline
    run: PipelineRun
    model: Model | None = None
    reason: str | None = None
    census: dict[str, dict[str, int]] = field(default_factory=dict)
    undone: list[tuple[Undoable, Loss]] = field(default_factory=list)
    lost: list[Loss] = field(default_factory=list)
    reruns: int = 0
    seconds: float = 0.0

    def messages(self) -> list[str]:
        """One line per rewrite undone and per loss kept, for the console and the log."""
        lines = [f"ort fusion kept: {u.describe()} was undone because {loss.describe()}" for u, loss in self.undone]
        lines += [f"ort fusion lost: {loss.describe()}; no rewrite of the pipeline explains it" for loss in self.lost]
        return lines

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"status": self.status}
        if self.reason is not None:
            found["reason"] = self.reason
        found["census"] = self.census
        found["undone"] = [
            {**u.as_dict(), **dataclasses.asdict(loss), "message": message}
            for (u, loss), message in zip(self.undone, self.messages(), strict=False)
        ]
        found["lost"] = [
            {**dataclasses.asdict(loss), "message": message}
            for loss, message in zip(self.lost, self.messages()[len(self.undone) :], strict=True)
        ]
        found["reruns"] = self.reruns
        found["seconds"] = round(self.seconds, 6)
        return found


Rerun = Callable[[Pipeline, Model], PipelineRun]


class RuntimeGuard:
    """The guard of one run: made on the input before the pipeline changes it (the original's
    census is taken meanwhile, in a child process), then :meth:`finish` ed on the output (or
    :meth:`cancel` ed when the pipeline raised)."""

    def __init__(self, model: Model, original_file: Path | None = None) -> None:
        """``original_file``: the ONNX file ``model`` was read from, which onnxruntime then loads
        as it is (a model saved again costs the time of writing its weights)."""
        from graphopt.numerics.isolated import start_isolated

        self.original = Snapshot(model)
        self._census = start_isolated(_take_censuses, [original_file or model])

    def cancel(self) -> None:
        self._census.cancel()

    def finish(self, model: Model, run: PipelineRun, pipeline: Pipeline, rerun: Rerun) -> GuardOutcome:
        """Compare onnxruntime's fused kernels on the original and on ``model``, the output of
        ``run`` of ``pipeline``; undo the rewrites that cost a fusion. ``rerun(pipeline, model)``
        runs a pipeline on a model in place (with a fresh pass context). The seconds counted
        are the guard's own: the original's census, taken while the pipeline ran, counts only
        as far as it outlasted the pipeline."""
        start = time.perf_counter()
        outcome = GuardOutcome("kept", pipeline, run)
        (before,) = _outcome(self._census.wait(), 1)
        (after,) = _censuses([model])
        if isinstance(before, str) or isinstance(after, str):
            which, reason = ("the original", before) if isinstance(before, str) else ("the output", after)
            outcome.status, outcome.reason = "not taken", f"{which}: {reason}"
            outcome.seconds = time.perf_counter() - start
            return outcome
        outcome.census = {"original": before.counts(), "output": after.counts()}
        search = _Search(self.original, pipeline, rerun, before)
        current = Trial(model, run, after, losses(before, after))
        unexplained: set[str] = set()
        spared: set[Undoable] = set()
        for _ in range(2 * MAX_UNDONE):
            target = next((loss for loss in current.losses if loss.kind not in unexplained), None)
            if target is None or len(outcome.undone) == MAX_UNDONE:
                break
            undone = [u for u, _ in outcome.undone]
            culprit = search.culprit(target.kind, undone, current.run, spared)
            if culprit is None:
                unexplained.add(target.kind)
                continue
            found = search.trial([*undone, culprit])
            if _trades(current, found):  # undoing it costs a fusion the output has: search again without it
                spared.add(culprit)
                continue
            outcome.undone.append((culprit, target))
            current = found
        current = self._minimal(outcome, search, current)
        if outcome.undone:
            outcome.status, outcome.model, outcome.run = "undone", current.model, current.run
            outcome.pipeline = without(pipeline, [u for u, _ in outcome.undone])
            if current.census is not None:
                outcome.census["output"] = current.census.counts()
        outcome.lost = current.losses
        if outcome.lost and not outcome.undone:
            outcome.status = "lost"
        outcome.reruns = search.reruns
        outcome.seconds = time.perf_counter() - start
        return outcome

    @staticmethod
    def _minimal(outcome: GuardOutcome, search: _Search, current: Trial) -> Trial:
        """Put back each rewrite undone whose undoing turned out not to be needed (two rewrites
        that cost one fusion together are found one after the other)."""
        if len(outcome.undone) < 2:
            return current
        for pair in list(outcome.undone):
            fewer = search.trial([u for u, loss in outcome.undone if (u, loss) != pair])
            if len(fewer.losses) <= len(current.losses) and not _trades(current, fewer):
                outcome.undone.remove(pair)
                current = fewer
        return current


def _trades(current: Trial, found: Trial) -> bool:
    """Whether ``found`` has fewer of some fused kernel than ``current`` (or no census)."""
    if found.census is None:
        return True
    return current.census is not None and bool(losses(current.census, found.census))


class _Search:
    """Reruns of the pipeline without some rewrites, each taken once (keyed by what it leaves out)."""

    def __init__(self, original: Snapshot, pipeline: Pipeline, rerun: Rerun, before: Census) -> None:
        self.original, self.pipeline, self.rerun, self.before = original, pipeline, rerun, before
        self.trials: dict[frozenset[Undoable], Trial] = {}
        self.reruns = 0

    def trial(self, undone: Sequence[Undoable]) -> Trial:
        key = frozenset(undone)
        found = self.trials.get(key)
        if found is None:
            model = self.original.model()
            self.reruns += 1
            census: Census | str
            try:
                run = self.rerun(without(self.pipeline, undone), model)
            except Exception:  # a rerun that fails (bad input without a rewrite) is no way out
                logger.debug("a rerun without %s failed:\n%s", undone, traceback.format_exc())
                run, census = PipelineRun(), "the rerun failed"
            else:
                (census,) = _censuses([model])
            # A rerun's output onnxruntime cannot load is no way out either: it counts as losing all.
            lost = losses(self.before, census if not isinstance(census, str) else Census())
            found = self.trials[key] = Trial(model, run, None if isinstance(census, str) else census, lost)
        return found

    def culprit(self, kind: str, undone: list[Undoable], run: PipelineRun, spared: set[Undoable]) -> Undoable | None:
        """The rewrite whose undoing keeps ``kind``, with ``undone`` left out already and
        ``spared`` never left out; None when leaving out all the others loses it still."""
        candidates = [u for u in undoable(run.runs) if u not in undone and u not in spared]

        def lost(count: int) -> bool:
            return any(loss.kind == kind for loss in self.trial([*undone, *candidates[:count]]).losses)

        if not candidates:
            return None
        kept, gone = len(candidates), 0  # leaving out all of them keeps it: seen at the end
        while kept - gone > 1:
            middle = (kept + gone) // 2
            if lost(middle):
                gone = middle
            else:
                kept = middle
        if kept == len(candidates) and lost(kept):
            return None
        return candidates[kept - 1]


def _censuses(models: list[Model | Path]) -> list[Census | str]:
    """The census of each model, taken in a child process, or why it could not be: onnxruntime
    refused the model (its message), or crashed (a crash there is a reason, not graphopt's end)."""
    from graphopt.numerics.isolated import run_isolated

    return _outcome(run_isolated(_take_censuses, models), len(models))


def _outcome(found: list[Census | str] | str, count: int) -> list[Census | str]:
    return [found] * count if isinstance(found, str) else found


def _take_censuses(models: list[Model | Path]) -> list[Census | str]:
    from graphopt.io import save

    found: list[Census | str] = []
    with tempfile.TemporaryDirectory(prefix="graphopt-guard-") as folder:
        for index, model in enumerate(models):
            if isinstance(model, Model):
                path = Path(folder) / str(index) / "model.onnx"
                save(model, path)
                made = {v.name for n in model.all_nodes() for v in n.outputs}
                names: set[str] | None = made | {v.name for v in model.graph.inputs}
            else:
                path, names = model, None
            try:
                found.append(census_of_file(path, names))
            except Exception as err:  # onnxruntime's refusal, in one line
                found.append(f"onnxruntime cannot load it at ORT_ENABLE_ALL: {' '.join(str(err).split())[:300]}")
    return found
