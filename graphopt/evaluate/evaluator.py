"""The constant-subgraph evaluator: a set of nodes and the arrays they read in, arrays out.

Nodes run in topological order through numpy kernels where one models the node (see
:mod:`graphopt.evaluate.base`); a node without one (or with a body, or reading such a
node's output) is deferred, and the deferred nodes, a set closed under "reads a deferred
output", run together in one onnxruntime session (:mod:`graphopt.evaluate.region`).

Never evaluated: ops of a domain with no evaluator (anything but the standard domain,
and onnxruntime's contrib ops where onnxruntime has a CPU kernel), random ops, and
training-mode Dropout; the answer would not be the one the model computes at run time.

The byte budget bounds what evaluation produces: declared static shapes are checked
before anything runs, kernels check each output before allocating it, and what is
produced so far is totalled after every kernel and after the session. The work budget
bounds what a Loop may cost: its trip count (when the region knows it) times the nodes of
its body, in node runs, is checked before the session; a session still running after
:data:`SECONDS_BUDGET` (a Loop whose condition never turns false) is stopped. Either is an
EvaluationError, which the passes report as a refusal.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import onnx.defs
import onnxruntime.capi.onnxruntime_pybind11_state as ort_state

# The kernel modules register themselves on import.
from graphopt.evaluate import elementwise, reduction, shaping  # noqa: F401
from graphopt.evaluate.base import Call, EvaluationError, Kernel, Unsupported, describe, kernel_for
from graphopt.evaluate.region import OutOfTime, run_region
from graphopt.ir import CONTRIB_DOMAIN, DataType, Node, Tensor, TensorType, Value, tensor_dtype
from graphopt.ir.constness import is_deterministic
from graphopt.ir.ops import CARRIERS, COMPARISONS

__all__ = ["Evaluator"]

_RANDOM_CONTRIB_OPS = frozenset({"Sampling", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout"})


# Node runs one evaluation's Loops may take (trip count times body nodes).
WORK_BUDGET = 10**6
# Seconds one onnxruntime session of an evaluation may run before it is stopped.
SECONDS_BUDGET = 30.0


class Evaluator:
    """Evaluates regions of nodes on given arrays, within ``byte_budget`` bytes of results
    and ``work_budget`` node runs of Loops."""

    def __init__(self, *, byte_budget: int = 256 << 20, work_budget: int = WORK_BUDGET) -> None:
        self.byte_budget = byte_budget
        self.work_budget = work_budget
        # Nodes of sessions stopped at the time budget: a later pass is refused at once.
        self.out_of_time: weakref.WeakSet[Node] = weakref.WeakSet()

    def can_evaluate(self, node: Node, opsets: Mapping[str, int]) -> bool:
        return _refusal(node, opsets) is None

    def evaluate(
        self,
        nodes: Sequence[Node],
        inputs: Mapping[Value, np.ndarray],
        outputs: Sequence[Value],
        opsets: Mapping[str, int],
    ) -> dict[Value, np.ndarray]:
        """The arrays of ``outputs`` (read-only), computed by ``nodes`` from ``inputs``.

        ``inputs`` holds an array for every value the region reads and does not produce,
        except initializers, whose data is read when they are missing from it.
        """
        region = list(dict.fromkeys(nodes))
        for node in region:
            reason = _refusal(node, opsets)
            if reason is not None:
                raise EvaluationError(f"{describe(node)} cannot be evaluated: {reason}")
            if node in self.out_of_time:
                raise EvaluationError(f"{describe(node)}: stopped earlier at the time budget of an evaluation")
        run = _Run(self.byte_budget, self.work_budget, inputs, opsets)
        produced = {v for node in region for v in node.outputs}
        for value in outputs:
            if value not in produced:
                run.array(value, "the region")
        order = _needed(_topological(region), outputs)
        run.check_declared(order)
        deferred: list[Node] = []
        late: set[Value] = set()
        chained = _float16_chains(order)
        for node in order:
            kernel = None
            if node not in chained and not late.intersection(_reads(node)):
                kernel = kernel_for(node, _opset(node.domain, opsets) or 0)
            if kernel is None or not run.kernel(node, kernel):
                deferred.append(node)
                late.update(node.outputs)
        if deferred:
            try:
                run.session(deferred, late, [v for v in dict.fromkeys(outputs) if v in late])
            except OutOfTime:
                self.out_of_time.update(deferred)
                raise
        return {value: _read_only(run.array(value, "the region")) for value in outputs}


class _Run:
    """One evaluation's arrays and the bytes it has produced."""

    def __init__(
        self, budget: int, work_budget: int, inputs: Mapping[Value, np.ndarray], opsets: Mapping[str, int]
    ) -> None:
        self.budget = budget
        self.work_budget = work_budget
        self.used = 0
        self.inputs = inputs
        self.opsets = opsets
        self.arrays: dict[Value, np.ndarray] = {}

    def array(self, value: Value, reader: str) -> np.ndarray:
        """The array of a computed value, a region input, or an initializer."""
        found = self.arrays.get(value)
        if found is not None:
            return found
        if value in self.inputs:
            found = np.asarray(self.inputs[value])
        elif isinstance(value.const, Tensor):
            found = np.asarray(value.const.numpy())
        else:
            raise EvaluationError(f"{reader} reads {value.name!r}, which has no array and no producer in the region")
        self.arrays[value] = found
        return found

    def charge(self, nbytes: int, what: str) -> None:
        if self.used + nbytes > self.budget:
            raise EvaluationError(
                f"{what}: {nbytes} more bytes would exceed the byte budget "
                f"({self.budget} bytes, {self.used} already produced)"
            )

    def check_declared(self, nodes: Iterable[Node]) -> None:
        declared = sum(_declared_bytes(v) for node in nodes for v in node.outputs)
        self.charge(declared, "the region's declared output shapes")

    def kernel(self, node: Node, kernel: Kernel) -> bool:
        """Run ``node``'s numpy kernel; False when the kernel leaves this case to onnxruntime."""
        label = describe(node)
        args = [None if v is None else self.array(v, label) for v in node.inputs]
        call = Call(node, _opset(node.domain, self.opsets) or 0, lambda nbytes: self.charge(nbytes, label))
        try:
            with np.errstate(all="ignore"):
                produced = kernel(call, *args)
        except Unsupported:
            return False
        except (ValueError, TypeError, IndexError, ArithmeticError) as err:
            raise EvaluationError(f"{label}: {err}") from err
        if isinstance(produced, (np.ndarray, np.generic)):
            produced = [produced]
        results = [np.asarray(r) for r in produced]
        if len(results) != len(node.outputs):
            raise EvaluationError(f"{label}: {len(results)} results for {len(node.outputs)} outputs")
        # Views of an input (Reshape, Transpose, Identity) hold no new memory.
        fresh = [r for r in results if not any(a is not None and np.may_share_memory(r, a) for a in args)]
        self.charge(sum(r.nbytes for r in fresh), label)
        self.used += sum(r.nbytes for r in fresh)
        self.arrays.update(zip(node.outputs, results))
        return True

    def session(self, nodes: list[Node], late: set[Value], wanted: list[Value]) -> None:
        label = "the onnxruntime region"
        feeds = {v: self.array(v, label) for node in nodes for v in _reads(node) if v not in late}
        self.check_work(nodes, feeds)
        results = run_region(nodes, feeds, wanted, self.opsets, self.budget - self.used, SECONDS_BUDGET)
        nbytes = sum(r.nbytes for r in results)
        self.charge(nbytes, label)
        self.used += nbytes
        self.arrays.update(zip(wanted, results))

    def check_work(self, nodes: list[Node], feeds: Mapping[Value, np.ndarray]) -> None:
        """Refuse Loops whose known trip counts make more node runs than the work budget."""
        work = 0
        for node in nodes:
            count = node.inputs[0] if node.op_type == "Loop" and node.inputs else None
            if count is None or count not in feeds or feeds[count].size != 1:
                continue  # no trip count, or one computed in the session: the time budget stops it
            body = sum(len(list(graph.all_nodes())) for graph in node.subgraphs())
            work += max(int(feeds[count].reshape(-1)[0]), 0) * max(body, 1)
            if work > self.work_budget:
                raise EvaluationError(
                    f"{describe(node)}: {int(feeds[count].reshape(-1)[0])} iterations of {body} nodes exceed the "
                    f"work budget of {self.work_budget} node runs"
                )


# Ops whose float16 kernels in onnxruntime's CPU provider move, pick or convert elements without computing.
_FLOAT16_MOVES = frozenset(
    {
        *CARRIERS,
        "Cast",
        "CastLike",
        "Concat",
        "GatherElements",
        "GatherND",
        "Identity",
        "Max",
        "Min",
        "Split",
        "Tile",
        "Where",
    }
)
# Ops whose outputs are never float16, whatever they read.
_NOT_FLOAT16 = frozenset({*COMPARISONS, "ArgMax", "ArgMin", "IsInf", "IsNaN", "NonZero", "Shape", "Size"})


def _float16_chains(order: list[Node]) -> set[Node]:
    """The nodes of every group of the region joined by float16 values (through any of _FLOAT16_MOVES) in which
    two or more nodes compute on float16: they run in onnxruntime, as the model would. Its CPU provider has no
    float16 kernel for the arithmetic (Add, Mul, Div, Pow, Sqrt, Cos, Sin, Exp, MatMul, the Reduce ops): it runs
    each in float32 behind Casts it inserts and drops the Cast pairs between them (around one move between them
    too), so a chain rounds to float16 only at its end. The numpy kernels round each op's result, as one op alone
    does in onnxruntime too: a rotary table folded so (2048 positions times 16 frequencies, rounded before their
    Cos) was up to 0.48 away from the cosines the model computes. A group with moves that onnxruntime does round
    between goes to it too: onnxruntime decides. An untyped value (a folded circuit's) is float16 where its
    producer reads float16 and writes floats like it."""
    members = set(order)
    leader: dict[Node, Node] = {node: node for node in order}

    def group(node: Node) -> Node:
        while leader[node] is not node:
            leader[node] = leader[leader[node]]
            node = leader[node]
        return node

    half: set[Value] = set()
    computing: list[Node] = []
    for node in order:
        read = [v for v in node.inputs if v is not None and (v in half or tensor_dtype(v) == DataType.FLOAT16)]
        for value in read:
            if value.producer in members:
                leader[group(node)] = group(value.producer)
        written = [v for v in node.outputs if _writes_float16(node, v, bool(read))]
        half.update(read, written)
        if read and written and node.op_type not in _FLOAT16_MOVES:
            computing.append(node)
    counts = Counter(group(node) for node in computing)
    return {node for node in order if counts[group(node)] >= 2}


def _writes_float16(node: Node, value: Value, reads_float16: bool) -> bool:
    declared = tensor_dtype(value)
    if declared is not None:
        return declared == DataType.FLOAT16
    if node.op_type in ("Cast", "CastLike"):
        return False  # the target type decides; an untyped one is not followed
    return reads_float16 and node.op_type not in _NOT_FLOAT16


def _reads(node: Node) -> list[Value]:
    """The values a node reads, its bodies' captures included."""
    reads = [v for v in node.inputs if v is not None]
    if node.attributes:
        reads += node.captures()
    return reads


def _topological(region: list[Node]) -> list[Node]:
    """The region's nodes, producers first, otherwise in the given order."""
    position = {node: index for index, node in enumerate(region)}
    producer = {v: node for node in region for v in node.outputs}
    consumers: dict[Node, list[Node]] = {node: [] for node in region}
    pending: dict[Node, int] = {}
    for node in region:
        sources = {producer[v] for v in _reads(node) if v in producer}
        pending[node] = len(sources)
        for source in sources:
            consumers[source].append(node)
    ready = [(position[n], n) for n in region if not pending[n]]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for consumer in consumers[node]:
            pending[consumer] -= 1
            if not pending[consumer]:
                heapq.heappush(ready, (position[consumer], consumer))
    if len(order) != len(region):
        stuck = next(n for n in region if pending[n])
        raise EvaluationError(f"the region has a cycle through {describe(stuck)}")
    return order


def _needed(order: list[Node], outputs: Sequence[Value]) -> list[Node]:
    """The nodes ``outputs`` depend on, in ``order``."""
    producer = {v: node for node in order for v in node.outputs}
    needed: set[Node] = set()
    stack = [producer[v] for v in outputs if v in producer]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(producer[v] for v in _reads(node) if v in producer)
    return [n for n in order if n in needed]


def _declared_bytes(value: Value) -> int:
    declared = value.type
    if not isinstance(declared, TensorType) or declared.shape is None:
        return 0
    dims = [d for d in declared.shape if isinstance(d, int)]
    if len(dims) != len(declared.shape):
        return 0
    count = math.prod(dims)
    return (count * declared.dtype.itemsize_bits + 7) // 8


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view, so the caller's own arrays keep their flags."""
    view = array.view()
    view.flags.writeable = False
    return view


def _opset(domain: str, opsets: Mapping[str, int]) -> int | None:
    if domain in ("", "ai.onnx"):
        return opsets.get("", opsets.get("ai.onnx"))
    return opsets.get(domain)


def _refusal(node: Node, opsets: Mapping[str, int]) -> str | None:
    """Why ``node`` must not be evaluated, or None when it may be."""
    opset = _opset(node.domain, opsets)
    if node.in_standard_domain:
        if opset is None:
            return "the model imports no opset of the standard domain"
        if not _has_schema(node.op_type, opset):
            return f"opset {opset} of the standard domain has no op {node.op_type}"
        if not is_deterministic(node, opset):
            return "training-mode Dropout is random" if node.op_type == "Dropout" else "it is random"
    elif node.domain == CONTRIB_DOMAIN:
        if opset is None:
            return f"the model imports no opset of {CONTRIB_DOMAIN}"
        if node.op_type in _RANDOM_CONTRIB_OPS:
            return "it is random"
        if not any(low <= opset <= high for low, high in _contrib_kernels().get(node.op_type, ())):
            return f"onnxruntime has no CPU kernel for it at opset {opset}"
    else:
        return f"no evaluator for the domain {node.domain!r}"
    if any(a.ref_attr_name for a in node.attributes.values()):
        return "an attribute refers to an attribute of its function"
    for body in node.subgraphs():
        for inner in body.all_nodes():
            reason = _refusal(inner, opsets)
            if reason is not None:
                return f"its body holds a {describe(inner)}: {reason}"
    return None


@lru_cache(maxsize=4096)
def _has_schema(op_type: str, opset: int) -> bool:
    return bool(onnx.defs.has(op_type, opset, ""))


@lru_cache(maxsize=1)
def _contrib_kernels() -> dict[str, list[tuple[int, int]]]:
    """onnxruntime's CPU kernels of the contrib domain: op -> opset ranges."""
    found: dict[str, list[tuple[int, int]]] = {}
    for definition in ort_state.get_all_opkernel_def():
        if definition.domain == CONTRIB_DOMAIN and definition.provider == "CPUExecutionProvider":
            found.setdefault(definition.op_name, []).append(tuple(definition.version_range))  # type: ignore[arg-type]
    return found
