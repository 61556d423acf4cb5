"""The shared proofs (graphopt/passes/rewrite/proofs.py) on small graphs: each proves what the graph shows, and
answers None (False, or a reason) where a dim, an entry or a spelling leaves it unproven."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import pytest

from graphopt.api import optimize, pass_context
from graphopt.io.onnx_io import from_proto
from graphopt.ir import Node, Value
from graphopt.passes.rewrite import proofs
from graphopt.passes.rewrite.engine import Refuse, Site
from graphopt.settings import Settings
from tests.passes.fuse_helpers import info, init, model, node

I64 = np.int64


class Graph:
    """``proto`` after shape inference: its values and nodes by (first output) name, and a Site on it."""

    def __init__(self, proto: onnx.ModelProto) -> None:
        ir = optimize(from_proto(proto), "shape-infer", strict=True, check=False).model
        self.site = Site(ir, ir.graph, ir.opset_in(ir.graph), "onnx", pass_context(Settings()))
        self.values: dict[str, Value] = {v.name: v for v in ir.graph.values()}
        self.nodes: dict[str, Node] = {n.outputs[0].name: n for n in ir.graph.nodes}

    def __getitem__(self, name: str) -> Value:
        return self.values[name]


def _split(target: Sequence[int], x: Sequence[int | str] = ("b", "s", 32), **attrs: int) -> Graph:
    """Transpose(Reshape(x, target), [0, 2, 1, 3]): a head split of ``x``."""
    return Graph(
        model(
            [
                node("Reshape", ["x", "target"], "split", **attrs),
                node("Transpose", ["split"], "heads", perm=proofs.HEADS),
            ],
            [info("x", list(x))],
            ["heads"],
            [init("target", np.array(target, I64))],
        )
    )


@pytest.mark.parametrize(
    ("target", "x", "found"),
    [
        ([0, 0, 4, 8], ("b", "s", 32), (4, 8)),
        ([0, 0, -1, 8], ("b", "s", 32), (4, 8)),  # the hidden size fixes the heads
        ([2, 5, 4, 8], (2, 5, 32), (4, 8)),
        ([0, 0, -1, 6], ("b", "s", 32), None),  # 32 is no multiple of 6
    ],
)
def test_a_head_split_gives_its_heads_and_head_size(target: list[int], x: tuple, found: tuple | None) -> None:
    g = _split(target, x)
    assert proofs.split_count(g["split"], g.site) == found
    assert proofs.head_count(g["heads"], g.site) == found


def test_a_head_split_with_a_dynamic_hidden_size_and_minus_one_heads_is_unproven() -> None:
    g = _split([0, 0, -1, 8], ("b", "s", "hidden"))
    assert proofs.split_count(g["split"], g.site) is None
    assert proofs.split_source(g["split"], g.site) is None


def test_the_source_of_a_head_split_and_its_transpose() -> None:
    g = _split([0, 0, 4, 8])
    assert proofs.split_source(g["split"], g.site) is g["x"]
    assert proofs.unsplit(g["heads"], 4, g.site) is g["x"]
    assert proofs.unsplit(g["heads"], 2, g.site) is None  # not the heads asked for
    assert proofs.unsplit(g["split"], 4, g.site) is None  # no Transpose


def test_a_static_split_reads_its_output_shape_only() -> None:
    assert proofs.static_split(_split([2, 5, 4, 8], (2, 5, 32)).nodes["split"]) == (4, 8)
    assert proofs.static_split(_split([0, 0, -1, 8], ("b", "s", "h")).nodes["split"]) is None  # heads unknown


def _merged(shape: Sequence[int], split_to: Sequence[int] | None = None) -> Graph:
    """x (2, 4, 5, 8) merged to ``shape``, and that split again to ``split_to``."""
    nodes = [node("Reshape", ["x", "merge_target"], "merged")]
    inits = [init("merge_target", np.array(shape, I64))]
    if split_to is not None:
        nodes.append(node("Reshape", ["merged", "split_target"], "split"))
        inits.append(init("split_target", np.array(split_to, I64)))
    return Graph(model(nodes, [info("x", [2, 4, 5, 8])], [nodes[-1].output[0]], inits))


def test_merged_heads_and_their_split() -> None:
    g = _merged([8, 5, 8], [2, 4, 5, 8])
    assert proofs.merged_source(g["merged"], 4) is g["x"]
    assert proofs.merged_source(g["merged"], None) is g["x"]
    assert proofs.merged_source(g["merged"], 2) is None
    assert proofs.splits_merged_heads(g.nodes["split"], 4)
    assert not proofs.splits_merged_heads(g.nodes["split"], 2)


def test_batch_and_heads_merged_with_the_rest_reshaped_are_not_merged_heads() -> None:
    g = _merged([8, 8, 5], [4, 2, 5, 8])  # the trailing dims reshaped, neither kept
    assert proofs.merged_source(g["merged"], 4) is None
    assert not proofs.splits_merged_heads(g.nodes["split"], 2)


def _merge(entries: list[str], allowzero: int = 0) -> Graph:
    """Reshape(y (b, s, 4, 8), Concat(entries)): the merge back, its target's entries named from ``dims``."""
    dims = {
        "zero": init("zero", np.array([0], I64)),
        "minus": init("minus", np.array([-1], I64)),
        "width": init("width", np.array([32], I64)),
    }
    nodes = [
        node("Shape", ["y"], "batch", start=0, end=1),
        node("Shape", ["y"], "shape"),
        node("Gather", ["shape", "one"], "seq_scalar", axis=0),
        node("Unsqueeze", ["seq_scalar", "axes"], "seq"),
        node("Concat", entries, "target", axis=0),
        node("Reshape", ["y", "target"], "merged", allowzero=allowzero),
    ]
    inits = [*dims.values(), init("one", np.array(1, I64)), init("axes", np.array([0], I64))]
    return Graph(model(nodes, [info("y", ["b", "s", 4, 8])], ["merged"], inits, opset=17))


def test_read_dim_reads_shape_slices_and_gathers() -> None:
    g = _merge(["batch", "seq", "width"])
    assert proofs.read_dim(g["batch"], g["y"]) == 0
    assert proofs.read_dim(g["seq"], g["y"]) == 1
    assert proofs.read_dim(g["width"], g["y"]) is None
    assert proofs.read_dim(g["seq"], g["merged"]) is None  # read from another value


@pytest.mark.parametrize(
    ("entries", "allowzero", "merged"),
    [
        (["batch", "seq", "width"], 0, True),
        (["zero", "zero", "width"], 0, True),
        (["zero", "minus", "width"], 0, True),  # one kept, the width fixed: the other follows
        (["zero", "zero", "width"], 1, False),  # allowzero: a 0 is a 0, not a copy
        (["seq", "batch", "width"], 0, False),  # batch and seq swapped
        (["batch", "seq", "minus"], 0, True),
    ],
)
def test_the_merge_back_to_batch_seq_and_width(entries: list[str], allowzero: int, merged: bool) -> None:
    g = _merge(entries, allowzero)
    refusal = proofs.merge_refusal(g.nodes["merged"], g.site, 32, "b", "s")
    assert (refusal is None) == merged, refusal


def test_a_reshape_to_its_own_dims_read_back() -> None:
    g = _merge(["batch", "seq", "width"])
    y = g["y"]
    assert not proofs.reshaped_to_itself(y, g["target"], g.site, y)  # a 3-D target cannot keep 4-D y
    four = Graph(
        model(
            [
                node("Shape", ["y"], "batch", start=0, end=1),
                node("Shape", ["y"], "seq", start=2, end=3),
                node("Concat", ["batch", "heads", "seq", "minus"], "target", axis=0),
                node("Reshape", ["y", "target"], "same"),
            ],
            [info("y", ["b", 4, "s", 8])],
            ["same"],
            [init("heads", np.array([4], I64)), init("minus", np.array([-1], I64))],
        )
    )
    assert proofs.reshaped_to_itself(four["y"], four["target"], four.site, four["y"])


@pytest.mark.parametrize(
    ("target", "allowzero", "same"),
    [
        ([0, -1, 0, 8], False, True),  # as the shape rules spell it: the batch and seq copied, the heads follow
        ([0, 4, 0, 8], False, True),
        ([0, 4, 0, 8], True, False),  # allowzero: a 0 is a 0
        ([0, -1, -1, 8], False, False),
        ([0, 8, 0, 4], False, False),  # heads and head size swapped
    ],
)
def test_a_reshape_to_its_own_dims_from_a_constant_target(target: list[int], allowzero: bool, same: bool) -> None:
    g = Graph(
        model(
            [node("Reshape", ["y", "target"], "out", allowzero=int(allowzero))],
            [info("y", ["b", 4, "s", 8])],
            ["out"],
            [init("target", np.array(target, I64))],
        )
    )
    assert proofs.reshaped_to_itself(g["y"], g["target"], g.site, g["y"], allowzero=allowzero) == same


@pytest.mark.parametrize(
    ("target", "found"),
    [
        ([2, 0, 8], [2, 3, 8]),  # the 0 spelled out from the result's known dim
        ([2, 3, 8], [2, 3, 8]),
        ([0, -1], "copies a dim (0) and has a -1 besides"),
    ],
)
def test_a_constant_target_spelled_out(target: list[int], found: list[int] | str) -> None:
    g = Graph(
        model(
            [node("Reshape", ["x", "target"], "y")],
            [info("x", ["b", 3, 8])] if target != [0, -1] else [info("x", ["b", "s", 8])],
            ["y"],
            [init("target", np.array(target, I64))],
        )
    )
    spelled = proofs.spelled_target(g.nodes["y"], g.site)
    if isinstance(found, str):
        assert isinstance(spelled, Refuse) and found in spelled.reason
    else:
        assert not isinstance(spelled, Refuse) and spelled.tolist() == found


def test_a_computed_target_with_one_unknown_entry() -> None:
    nodes = [node("Shape", ["x"], "lead", start=0, end=1), node("Concat", ["lead", "rest"], "target", axis=0)]
    nodes.append(node("Reshape", ["y", "target"], "out"))
    inputs = [info("x", ["b", 6]), info("y", ["b", 2, 3])]
    g = Graph(model(nodes, inputs, ["out"], [init("rest", np.array([6], I64))]))
    assert proofs.one_unknown(g.nodes["out"], g.site) == [-1, 6]
    assert proofs.ints_of(g.site, g["target"]) is not None


@pytest.mark.parametrize(("shape", "rank", "scalar"), [([], 3, True), ([1, 1], 2, True), ([1, 1], 1, False)])
def test_a_scalar_of_rank(shape: list[int], rank: int, scalar: bool) -> None:
    g = Graph(model([node("Identity", ["c"], "y")], [info("c", shape)], ["y"]))
    assert proofs.scalar_of_rank(g["c"], rank) == scalar
    assert not proofs.scalar_of_rank(g["c"], None)


def test_the_untransposed_key_in_each_spelling() -> None:
    nodes = [
        node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]),
        node("Transpose", ["ks"], "kt_split", perm=[0, 2, 3, 1]),
        node("Transpose", ["k"], "other", perm=[0, 2, 1, 3]),
    ]
    g = Graph(model(nodes, [info("k", [2, 4, 5, 8]), info("ks", [2, 5, 4, 8])], ["kt", "kt_split", "other"]))
    key = proofs.untransposed_key(g["kt"])
    assert key is not None and key.value is g["k"] and key.perm is None
    split = proofs.untransposed_key(g["kt_split"])
    assert split is not None and split.value is g["ks"] and split.perm == proofs.HEADS
    assert proofs.untransposed_key(g["other"]) is None


def test_the_merged_key() -> None:
    nodes = [node("Reshape", ["k", "target"], "merged"), node("Transpose", ["merged"], "kt", perm=[0, 2, 1])]
    g = Graph(model(nodes, [info("k", [2, 4, 5, 8])], ["kt"], [init("target", np.array([8, 5, 8], I64))]))
    key = proofs.merged_key(g["kt"], 4)
    assert key is not None and key.value is g["k"]
    assert proofs.merged_key(g["kt"], 2) is None


def _repeated(expand: list[int], target: list[int]) -> Graph:
    """Reshape(Expand(Unsqueeze(kv (b, 2, s, 8), [2]), expand), target): grouped-query attention's repeat."""
    nodes = [
        node("Unsqueeze", ["kv", "axes"], "wide"),
        node("Expand", ["wide", "expand"], "expanded"),
        node("Reshape", ["expanded", "target"], "repeated"),
    ]
    inits = [init(n, np.array(v, I64)) for n, v in (("axes", [2]), ("expand", expand), ("target", target))]
    return Graph(model(nodes, [info("kv", [3, 2, 5, 8])], ["repeated"], inits))


def test_the_unrepeated_kv_heads() -> None:
    g = _repeated([3, 2, 2, 5, 8], [3, 4, 5, 8])
    assert proofs.unrepeated(g["repeated"], g.site) is g["kv"]
    wrong = _repeated([3, 2, 2, 5, 8], [3, 4, 5, 8][::-1])  # not (B, Hkv * n, S, d)
    assert proofs.unrepeated(wrong["repeated"], wrong.site) is wrong["repeated"]


def _merge_back(target: Sequence[int] | str, x: Sequence[int | str | None] = ("b", 6, 4, 5)) -> bool:
    """proofs.reshaped_back of Reshape(Reshape(x, [0, -1]), target) to x (the flattening keeps x's batch):
    ``target`` constant, or "shape" Shape(x), "shape-from-1" Shape(x, start=1), "read" Concat(Shape(x, 0, 1), [6],
    Shape(x, 2, 3), [-1])."""
    nodes = [node("Reshape", ["x", "flat"], "flat_x")]
    params = [init("flat", np.array([0, -1], I64))]
    if target in ("shape", "shape-from-1"):
        nodes.append(node("Shape", ["x"], "target", **({"start": 1} if target == "shape-from-1" else {})))
    elif target == "read":
        nodes += [node("Shape", ["x"], "batch", start=0, end=1), node("Shape", ["x"], "height", start=2, end=3)]
        nodes.append(node("Concat", ["batch", "channels", "height", "rest"], "target", axis=0))
        params += [init("channels", np.array([6], I64)), init("rest", np.array([-1], I64))]
    else:
        params.append(init("target", np.array(target, I64)))
    nodes.append(node("Reshape", ["flat_x", "target"], "back"))
    graph = Graph(model(nodes, [info("x", list(x))], ["back"], params))
    return proofs.reshaped_back(graph.nodes["back"], graph["x"], graph.site, (0,))


@pytest.mark.parametrize(
    ("target", "x", "back"),
    [
        ("shape", ("b", 6, 4, 5), True),
        ("shape", (None, 6, None, None), True),  # Shape(x) proves dims no one named
        ("shape-from-1", ("b", 6, 4, 5), False),
        ([0, 6, 4, 5], ("b", 6, 4, 5), True),  # the batch copied from the flattening, which kept it
        ([-1, 6, 4, 5], ("b", 6, 4, 5), True),  # the element count fixes the one -1
        ([0, 6, 5, 4], ("b", 6, 4, 5), False),
        ([0, 0, 4, 5], ("b", 6, 4, 5), False),  # a 0 at an axis the flattening did not keep
        ([0, 6, -1], ("b", 6, 4, 5), False),
        ([0, 6, 4, 5], ("b", 6, "h", 5), False),  # 4 is not provably h
        ("read", ("b", 6, "h", "w"), True),
    ],
)
def test_a_reshape_back_to_its_source_shape(target: list[int] | str, x: tuple, back: bool) -> None:
    assert _merge_back(target, x) is back


# -- projections ----------------------------------------------------------------------------------------------


def _projection(x: Sequence[int | str], bias: Sequence[int]) -> Graph:
    """MatMul(x, W) + bias with a constant 8 x 4 W."""
    return Graph(
        model(
            [node("MatMul", ["x", "w"], "product"), node("Add", ["product", "bias"], "total")],
            [info("x", list(x))],
            ["total"],
            [init("w", np.ones((8, 4), np.float32)), init("bias", np.ones(bias, np.float32))],
        )
    )


@pytest.mark.parametrize(
    ("x", "bias", "gemm"),
    [
        (("b", 3, 8), (4,), True),  # one dynamic dim: the Reshape back takes -1 there
        ((2, 3, 8), (1, 1, 4), True),  # a bias of higher rank read as its vector
        (("b", "s", 8), (4,), False),  # two dynamic dims: no constant target for the Reshape back
        (("b", 3, 8), (3, 4), False),  # a bias over more than the last axis
        ((3, 8), (4,), False),  # 2-D: matmul-add-gemm's, not the projection's
    ],
)
def test_a_projection_is_written_as_one_gemm_where_its_shape_allows(
    x: tuple[int | str, ...], bias: tuple[int, ...], gemm: bool
) -> None:
    g = _projection(x, bias)
    assert proofs.projected_as_gemm(g["total"], g.site) is gemm
