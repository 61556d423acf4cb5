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
SkipLayerNormalization) is spared, and the search goes on without it, past the kinds that
undoing it alone keeps (those losses are its own); at the end each rewrite undone is put back
if the others suffice.

An output onnxruntime cannot load at ORT_ENABLE_ALL, where it loads the original, has lost the
session itself (census.Loss.unloaded), searched for and undone the same way: onnxruntime 1.32's
Q/DQ propagation refused outputs at opset 21 and up where a fusion left a move after a
DequantizeLinear.

The census cannot see a kernel that is kept but slower (a MultiHeadAttention with a 4-D
bias where onnxruntime formed no attention kernel at all): timing is ``--tune``'s work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphopt.files import scratch_folder
from graphopt.ir import Model
from graphopt.ir.clone import Snapshot
from graphopt.ir.stats import model_stats
from graphopt.passes.base import Pass
from graphopt.passes.pipeline import Group, PassRun, Pipeline, PipelineRun, Step, default_pipeline
from graphopt.runtime.census import UNLOADED, Census, Loss, census_of_file, losses

if TYPE_CHECKING:
    from graphopt.numerics.isolated import Isolated

__all__ = ["MAX_UNDONE", "GuardOutcome", "RuntimeGuard", "Undoable", "guards", "undoable", "without"]

logger = logging.getLogger(__name__)

# Most rewrites undone for one model: each costs a bisection (log2 of the rewrites applied).
MAX_UNDONE = 4
# Weights up to which the original's and the output's censuses run at once (two more copies).
SIDE_BY_SIDE_BYTES = 2**30
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
    ``model``, ``run`` and ``pipeline`` are the rerun's), "lost" (a loss no rewrite explains, the
    session itself among them: onnxruntime could not load the output) or "not taken"
    (``reason``: onnxruntime could not load the original)."""

    status: str
    pipeline: Pipeline
    run: PipelineRun
    model: Model | None = None
    reason: str | None = None
    census: dict[str, dict[str, int]] = field(default_factory=dict)
    undone: list[tuple[Undoable, Loss]] = field(default_factory=list)
    lost: list[Loss] = field(default_factory=list)
    # Rewrites that cost a fusion and stay, since undoing one costs another: (the rewrite, the
    # kind it costs, what undoing it costs).
    spared: list[tuple[Undoable, str, str]] = field(default_factory=list)
    reruns: int = 0
    seconds: float = 0.0

    def messages(self) -> list[str]:
        """One line per rewrite undone and per loss kept, for the console and the log."""
        lines = [
            f"ort {_what(loss)} kept: {u.describe()} was undone because {loss.describe()}" for u, loss in self.undone
        ]
        return lines + [f"ort {_what(loss)} lost: {loss.describe()}; {self._why_lost(loss)}" for loss in self.lost]

    def _why_lost(self, loss: Loss) -> str:
        costing = [(u, trade) for u, kind, trade in self.spared if kind == loss.kind]
        if costing:
            u, trade = costing[0]
            return f"{u.describe()} costs it and stays, since without it {trade}"
        if self.spared:
            kept = ", ".join(dict.fromkeys(u.describe() for u, _, _ in self.spared))
            return f"no rewrite explains it but {kept}, which stays"
        return "no rewrite of the pipeline explains it"

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


def _what(loss: Loss) -> str:
    return "session" if loss.kind == UNLOADED else "fusion"


Rerun = Callable[[Pipeline, Model], PipelineRun]


class RuntimeGuard:
    """The guard of one run: made on the input before the pipeline changes it, then
    :meth:`finish` ed on the output."""

    def __init__(self, model: Model, original_file: Path | None = None) -> None:
        """``original_file``: the ONNX file ``model`` was read from, which onnxruntime then loads
        as it is (a model saved again costs the time of writing its weights)."""
        self.original = Snapshot(model)
        # The file's census places kernels at these names, read here rather than from the file
        # again (its weights parsed for the names alone: 0.1 s on a 100 MB model).
        self.original_file = (original_file, _value_names(model)) if original_file is not None else None
        self._original_census: Isolated[list[Census | str]] | None = None
        self._started_seconds = 0.0

    def start(self, model: Model) -> None:
        """Start the original file's census beside what the caller does next with the output
        ``model`` (the runner saves it, then :meth:`finish` takes its census from that file)."""
        if self.original_file is not None and self._original_census is None and _small_enough(model):
            start = time.perf_counter()
            self._original_census = _start_censuses([self.original_file])
            self._started_seconds += time.perf_counter() - start

    def finish(
        self, model: Model, run: PipelineRun, pipeline: Pipeline, rerun: Rerun, output_file: Path | None = None
    ) -> GuardOutcome:
        """Compare onnxruntime's fused kernels on the original and on ``model``, the output of
        ``run`` of ``pipeline``; undo the rewrites that cost a fusion. ``rerun(pipeline, model)``
        runs a pipeline on a model in place (with a fresh pass context). ``output_file``: the
        ONNX file ``model`` was saved to, which onnxruntime then loads (else it is saved here).

        Both censuses are taken here, side by side in two child processes, rather than the
        original's while the pipeline runs: a session load beside the pipeline slowed the
        passes about as much as it saved (measured on resnet50: the passes took 0.21 s alone,
        0.41-0.79 s beside it). The original's starts earlier with :meth:`start`, beside the
        output's save."""
        start = time.perf_counter()
        outcome = GuardOutcome("kept", pipeline, run)
        output: Model | tuple[Path, set[str]] = (output_file, _value_names(model)) if output_file else model
        before, after = self._first_censuses(model, output)
        if isinstance(before, str):
            outcome.status, outcome.reason = "not taken", f"the original: {before}"
            outcome.seconds = time.perf_counter() - start + self._started_seconds
            return outcome
        # An output onnxruntime cannot load where it loads the original has lost the session
        # itself (an onnxruntime bug it trips, as a Q/DQ pair it propagates at opset 21 and up):
        # the rewrite that made it so is searched for and undone like a lost fusion.
        if isinstance(after, str):
            outcome.census = {"original": before.counts(), "output": {}}
            current = Trial(model, run, None, [Loss.unloaded(after)])
        else:
            outcome.census = {"original": before.counts(), "output": after.counts()}
            current = Trial(model, run, after, losses(before, after))
        search = _Search(self.original, pipeline, rerun, before)
        unexplained: set[str] = set()
        spared: set[Undoable] = set()
        for _ in range(2 * MAX_UNDONE):
            target = next((loss for loss in current.losses if loss.kind not in unexplained), None)
            if target is None or len(outcome.undone) == MAX_UNDONE:
                break
            undone = [u for u, _ in outcome.undone]
            if search.kept_undoing_one_of(spared, target.kind, undone):  # the loss is a trade kept: no other search
                unexplained.add(target.kind)
                continue
            culprit = search.culprit(target.kind, undone, current.run, spared)
            if culprit is None:
                unexplained.add(target.kind)
                continue
            found = search.trial([*undone, culprit])
            if _trades(current, found):  # undoing it costs a fusion the output has: search again without it
                spared.add(culprit)
                outcome.spared.append((culprit, target.kind, _trade(current, found)))
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
        outcome.seconds = time.perf_counter() - start + self._started_seconds
        return outcome

    def _first_censuses(self, model: Model, output: Model | tuple[Path, set[str]]) -> list[Census | str]:
        """The censuses of the original and of the output: the original's started already (:meth:`start`)."""
        early, self._original_census = self._original_census, None
        if early is None:
            original: Model | tuple[Path, set[str]] = self.original_file or self.original.model()
            return _censuses([original, output], side_by_side=_small_enough(model))
        after = _start_censuses([output])
        return [_outcome(early.wait(), 1)[0], _outcome(after.wait(), 1)[0]]

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


def _trade(current: Trial, found: Trial) -> str:
    """What ``found`` costs against ``current``, where :func:`_trades` holds."""
    if found.census is None or current.census is None:
        return "the pipeline fails or onnxruntime cannot load the output"
    return losses(current.census, found.census, removed=False)[0].describe()


def _trades(current: Trial, found: Trial) -> bool:
    """Whether ``found`` has fewer of some fused kernel than ``current`` (or no census). Kernels
    gone with the Convs they ran count here: the fused Convs fold made of an ensemble's Gemms are
    what undoing it costs, although the Convs go too."""
    if found.census is None:
        return True
    return current.census is not None and bool(losses(current.census, found.census, removed=False))


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
            lost = (
                [Loss.unloaded(census), *losses(self.before, Census())]
                if isinstance(census, str)
                else losses(self.before, census)
            )
            found = self.trials[key] = Trial(model, run, None if isinstance(census, str) else census, lost)
        return found

    def kept_undoing_one_of(self, spared: set[Undoable], kind: str, undone: list[Undoable]) -> bool:
        """Whether a trial taken already keeps ``kind`` undoing one of ``spared`` beside
        ``undone``: the loss is that rewrite's, which stays for the fusion it brings, and no
        other rewrite is searched for it (wide_ensemble: fold, spared for its FusedConvs,
        accounts for the FusedGemms and the NCHWc reorders, and a search past it cost a rerun)."""
        for rewrite in spared:
            found = self.trials.get(frozenset([*undone, rewrite]))
            if found is not None and all(loss.kind != kind for loss in found.losses):
                return True
        return False

    def culprit(self, kind: str, undone: list[Undoable], run: PipelineRun, spared: set[Undoable]) -> Undoable | None:
        """The rewrite whose undoing keeps ``kind``, with ``undone`` left out already and
        ``spared`` never left out; None when leaving out all the others loses it still."""
        candidates = [u for u in undoable(run.runs) if u not in undone and u not in spared]

        def lost(count: int) -> bool:
            return any(loss.kind == kind for loss in self.trial([*undone, *candidates[:count]]).losses)

        # Leaving out all of them first: a loss no rewrite explains costs one rerun, not a bisection.
        if not candidates or lost(len(candidates)):
            return None
        kept, gone = len(candidates), 0
        while kept - gone > 1:
            middle = (kept + gone) // 2
            if lost(middle):
                gone = middle
            else:
                kept = middle
        return candidates[kept - 1]


def _censuses(models: list[Model | tuple[Path, set[str]]], *, side_by_side: bool = False) -> list[Census | str]:
    """The census of each model (or ONNX file, with its value names), taken in a child process,
    or why it could not be: onnxruntime refused the model (its message), or crashed (a crash
    there is a reason, not graphopt's end). ``side_by_side``: each in a child of its own, all at
    once (else one child takes them in turn)."""
    if not side_by_side:
        return _outcome(_start_censuses(models).wait(), len(models))
    children = [_start_censuses([model]) for model in models]
    return [_outcome(child.wait(), 1)[0] for child in children]


def _start_censuses(models: list[Model | tuple[Path, set[str]]]) -> Isolated[list[Census | str]]:
    """A child process taking the censuses of ``models`` in turn (see :func:`_censuses`)."""
    import onnxruntime  # noqa: F401  # here: each child forked below has it (0.1 s of CPU each)

    from graphopt.numerics.isolated import start_isolated

    return start_isolated(_take_censuses, models)


def _small_enough(model: Model) -> bool:
    """Whether two censuses may run at once beside this process: each child holds the model's
    weights in onnxruntime again, so a large model is taken one at a time."""
    return model_stats(model).initializer_bytes <= SIDE_BY_SIDE_BYTES


def _outcome(found: list[Census | str] | str, count: int) -> list[Census | str]:
    return [found] * count if isinstance(found, str) else found


def _value_names(model: Model) -> set[str]:
    """The names a census may place a kernel at: the graph's inputs and what its nodes make."""
    return {v.name for n in model.all_nodes() for v in n.outputs} | {v.name for v in model.graph.inputs}


def _take_censuses(models: list[Model | tuple[Path, set[str]]]) -> list[Census | str]:
    from graphopt.io import save

    found: list[Census | str] = []
    with scratch_folder() as folder:
        for index, model in enumerate(models):
            if isinstance(model, Model):
                path, names = folder / str(index) / "model.onnx", _value_names(model)
                save(model, path)
            else:
                path, names = model
            try:
                found.append(census_of_file(path, names))
            except Exception as err:  # onnxruntime's refusal, in one line
                found.append(f"onnxruntime cannot load it at ORT_ENABLE_ALL: {' '.join(str(err).split())[:300]}")
    return found
