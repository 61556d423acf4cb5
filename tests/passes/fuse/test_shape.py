"""The shape rules' table: Reshape / Transpose / Slice / Cast chains, and the two noop rules the shape family shares.
Each rule fires on its model and refuses its perturbations (tests/passes/fuse/table.py says how); a rule newer
than the exporter fixtures has its case on an export too, and the family's own tests follow its table."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto

from tests.numerics import assert_same_outputs, make_feeds
from tests.passes.fuse.table import (
    BOTH_DYNAMIC,
    ERF_MLP,
    F16,
    LATE,
    NO_ATTR,
    NO_GATE,
    SLICE_INPUTS,
    TS_MLP,
    Case,
    Exported,
    Perturb,
    attr_at,
    constant_at,
    exported_mlp,
    set_attr,
    set_const,
    set_shape,
    table_tests,
    untyped_at,
)
from tests.passes.fuse_exported import FIXTURES, fixture_inputs
from tests.passes.fuse_helpers import fires, fuse, info, init, model, node, ops, refused
from tests.passes.fuse_models import (
    computed_reshape,
)


def _transposes() -> onnx.ModelProto:
    return model(
        [
            node("Transpose", ["x"], "t", perm=[1, 2, 0]),
            node("Transpose", ["t"], "u", perm=[2, 0, 1]),
            node("Relu", ["u"], "y"),
        ],
        [info("x", [2, 3, 4])],
        ["y"],
    )


def _identity_transpose() -> onnx.ModelProto:
    return model(
        [node("Transpose", ["x"], "t", perm=[0, 1, 2]), node("Relu", ["t"], "y")], [info("x", [2, 3, 4])], ["y"]
    )


def _layouts(outer: str, target: list[int] | None = None) -> Callable[[], onnx.ModelProto]:
    """Flatten(x) then a Reshape to ``target`` or an Unsqueeze at 0."""

    def build() -> onnx.ModelProto:
        second = node("Reshape", ["f", "s"], "y") if outer == "Reshape" else node("Unsqueeze", ["f", "s"], "y")
        values = target if outer == "Reshape" else [0]
        return model(
            [node("Flatten", ["x"], "f", axis=1), second],
            [info("x", [2, 3, 4])],
            ["y"],
            [init("s", np.array(values, np.int64))],
        )

    return build


def _pooled_transpose() -> onnx.ModelProto:
    """ConvNeXt's head as dynamo writes it: pooled NHWC [b, 1, 1, C] to NCHW, then flattened."""
    return model(
        [node("Relu", ["x"], "r"), node("Transpose", ["r"], "t", perm=[0, 3, 1, 2]), node("Reshape", ["t", "s"], "y")],
        [info("x", ["b", 1, 1, 8])],
        ["y"],
        [init("s", np.array([-1, 8], np.int64))],
    )


def _unsqueezes() -> onnx.ModelProto:
    return model(
        [node("Unsqueeze", ["x", "a1"], "u"), node("Unsqueeze", ["u", "a2"], "y")],
        [info("x", ["b", "s"])],
        ["y"],
        [init("a1", np.array([1], np.int64)), init("a2", np.array([0, 3], np.int64))],
    )


def _slices() -> onnx.ModelProto:
    """x[:, ::2][..., 1:7]: the second Slice's axis given as -1."""
    whole = np.iinfo(np.int64).max
    bounds = {"s1": [0], "e1": [whole], "a1": [1], "t1": [2], "s2": [1], "e2": [7], "a2": [-1]}
    return model(
        [node("Slice", ["x", "s1", "e1", "a1", "t1"], "s"), node("Slice", ["s", "s2", "e2", "a2"], "y")],
        [info("x", ["b", 6, 8])],
        ["y"],
        [init(name, np.array(values, np.int64)) for name, values in bounds.items()],
    )


def _casts(middle: int = TensorProto.FLOAT, source: int = F16) -> onnx.ModelProto:
    return model(
        [node("Cast", ["x"], "c", to=middle), node("Cast", ["c"], "d", to=source), node("Neg", ["d"], "y")],
        [info("x", [2, 3], source)],
        [info("y", None, source)],
    )


def _same_type_cast(to: int = TensorProto.FLOAT) -> onnx.ModelProto:
    return model([node("Cast", ["x"], "c", to=to), node("Neg", ["c"], "y")], [info("x", [2, 3])], [info("y", None, to)])


CASES: dict[str, Case] = {
    "transpose-transpose": Case(
        _transposes,
        {"Relu": 1},
        "t",
        "n/a: any two perms compose",
        Perturb(lambda p: set_shape("x", None)(set_attr("t", "u", perm=None)(p)), "the rank is unknown"),
        NO_GATE,
    ),
    "transpose-identity": Case(
        _identity_transpose,
        {"Relu": 1},
        "n/a: one node",
        Perturb(set_attr("t", perm=[0, 2, 1]), "not the identity"),
        "n/a: the perm decides",
        NO_GATE,
    ),
    "reshape-chain": Case(
        _layouts("Reshape", [4, -1]),
        {"Reshape": 1},
        "f",
        Perturb(
            lambda proto: set_const("s", [0, -1])(set_shape("x", ["b", 3, 4])(proto)),
            "copies a dim (0) and has a -1 besides",
            note="a dynamic dim copied beside a -1",
        ),
        "n/a: the constant target decides",
        NO_GATE,
    ),
    "reshape-transpose": Case(
        _pooled_transpose,
        {"Relu": 1, "Reshape": 1},
        "t",
        Perturb(set_attr("t", perm=[3, 0, 1, 2]), "moves data", note="a perm moving data"),
        Perturb(set_shape("x", ["b", "h", 1, 8]), "moves data", note="a dim not provably 1"),
        NO_GATE,
    ),
    "layout-chain-static": Case(
        _layouts("Unsqueeze"),
        {"Reshape": 1},
        "f",
        NO_ATTR,
        Perturb(set_shape("x", ["b", 3, 4]), "not static"),
        NO_GATE,
    ),
    "unsqueeze-unsqueeze": Case(
        _unsqueezes,
        {"Unsqueeze": 1},
        "u",
        NO_ATTR,
        Perturb(set_shape("x", None), "the axes or the rank are unknown"),
        NO_GATE,
    ),
    "slice-slice": Case(
        _slices,
        {"Slice": 1},
        "s",
        Perturb(set_const("a2", [1]), "share an axis", note="the second Slice's axis the first's"),
        Perturb(set_shape("x", None), "a negative axis needs x's rank"),
        SLICE_INPUTS,
    ),
    "reshape-one-unknown": Case(
        lambda: computed_reshape([4]),
        {"Reshape": 1},
        "n/a: one node (the shape plumbing goes with it when nothing else reads it)",
        Perturb(set_attr("y", allowzero=1), "allowzero"),
        Perturb(set_shape("x", None), "not provable"),
        NO_GATE,
        passes="shape-infer,fuse,dce",
    ),
    "cast-chain": Case(
        _casts,
        {"Neg": 1},
        "c",
        Perturb(lambda p: _casts(middle=F16, source=TensorProto.FLOAT), "may lose values", feeds=make_feeds),
        "n/a: types only",
        NO_GATE,
    ),
    "cast-to-same-type": Case(
        _same_type_cast,
        {"Neg": 1},
        "n/a: one node",
        Perturb(lambda p: _same_type_cast(F16), "a real conversion"),
        "n/a: types only",
        NO_GATE,
    ),
    "reshape-through-elementwise": Case(
        lambda: exported_mlp(**ERF_MLP),
        {"Reshape": 2, "Gemm": 2, "Constant": 3, "Div": 1, "Erf": 1, "Add": 1, "Mul": 2},
        f"{TS_MLP}intermediate/intermediate_act_fn/Mul_1_output_0",
        "n/a: the pattern reads no attribute (the element-wise ops keep their own)",
        Perturb(
            lambda p: set_shape(ERF_MLP["start"], ["batch", "sequence", 32])(p),
            None,
            note="no projection Reshapes to take (batch and sequence dynamic)",
        ),
        NO_GATE,
        LATE,
        passes="shape-infer,fuse,noop,dce",  # dce drops the element-wise ops the rewritten ones replace
    ),
}

EXPORTED: dict[str, Exported | str] = {
    "reshape-through-elementwise": "n/a: its CASES entry is the exported bert_ts MLP at a static sequence",
    "unsqueeze-unsqueeze": Exported(
        ("mpt_dynamo",),
        {"Unsqueeze": 1},
        "n/a: the pattern reads no attribute (the axes are constant inputs)",
        untyped_at(("x",), "the axes or the rank are unknown", undeclared=True),
        NO_GATE,
        interior="n/a: the inner Unsqueeze (the causal mask's arange[None, None]) is exported: its other Unsqueeze "
        "reader keeps a copy; the hand-built case's reader and output perturbations stand",
    ),
    "slice-slice": Exported(
        ("levit_dynamo", "levit_ts"),
        {"Slice": 1},
        constant_at("axes_outer", lambda axes: axes - 1, "share an axis", "the second Slice's axis the first's"),
        "n/a: the exporters write non-negative axes, which need no shape (the case built here has a negative one)",
        SLICE_INPUTS,
        interior="n/a: the inner Slice is exported (a copy stands for it where other Slices read it); the hand-built "
        "case's reader and output perturbations stand",
    ),
    "reshape-transpose": Exported(
        ("convnext_dynamo",),
        {"Transpose": 17},  # the export's 18, the head's gone
        attr_at("inner", "moves data", perm=[3, 0, 1, 2]),
        untyped_at(("x",), "the input's rank is unknown"),
        NO_GATE,
    ),
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "cast-chain",
        "cast-to-same-type",
        "layout-chain-static",
        "reshape-chain",
        "reshape-one-unknown",
        "transpose-identity",
        "transpose-transpose",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))


def test_reshape_through_elementwise_takes_a_region_of_one_op() -> None:
    """The dynamo export's MLP: one Gelu between the projections' Reshapes (the table's case is the five ops of the
    TorchScript export's erf GELU)."""
    settings = {**LATE, "passes": "shape-infer,fuse,noop,dce"}  # noop drops the Reshape to Gelu's input shape
    fires(exported_mlp(), "reshape-through-elementwise", {"Reshape": 2, "Gemm": 2, "Gelu": 1}, **settings)
    refused(BOTH_DYNAMIC(exported_mlp()), "reshape-through-elementwise", **LATE)


def test_transpose_pairs_compose_or_vanish() -> None:
    pair = model(
        [
            node("Transpose", ["x"], "t", perm=[1, 2, 0]),
            node("Transpose", ["t"], "u", perm=[2, 0, 1]),
            node("Relu", ["u"], "y"),
        ],
        [info("x", [2, 3, 4])],
        ["y"],
    )
    fires(pair, "transpose-transpose", {"Relu": 1})
    exposed = model(
        [node("Transpose", ["x"], "t", perm=[1, 2, 0]), node("Transpose", ["t"], "y", perm=[2, 0, 1])],
        [info("x", [2, 3, 4])],
        ["t", "y"],
    )
    refused(exposed, "transpose-transpose")


def test_reshape_chains_collapse_spelling_out_the_dims_a_zero_copies() -> None:
    def chain(target: list[int], batch: int | str = 2) -> onnx.ModelProto:
        return model(
            [node("Flatten", ["x"], "f", axis=1), node("Reshape", ["f", "s"], "y")],
            [info("x", [batch, 3, 4])],
            ["y"],
            [init("s", np.array(target, np.int64))],
        )

    fires(chain([4, -1]), "reshape-chain", {"Reshape": 1})
    # the 0 copies Flatten's first dim: 2, or the batch, which the one -1 then stands for
    for batch in (2, "batch"):
        fires(chain([0, 3, 4], batch), "reshape-chain", {"Reshape": 1})
    refused(chain([0, -1], "batch"), "reshape-chain")


def test_a_reshape_pair_around_a_scale_goes_for_a_scalar_only() -> None:
    def scaled(scale: np.ndarray) -> onnx.ModelProto:
        return model(
            [node("Reshape", ["x", "rows"], "r"), node("Mul", ["r", "c"], "m"), node("Reshape", ["m", "heads"], "y")],
            [info("x", [2, 3, 8])],
            ["y"],
            [
                init("rows", np.array([-1, 8], np.int64)),
                init("heads", np.array([2, 3, 2, 4], np.int64)),
                init("c", scale),
            ],
        )

    late = {"fuse_late": True}
    dce = "shape-infer,fuse,dce"  # dce drops the Mul and the Reshape the rewritten ones stand for
    fires(
        scaled(np.full((1, 1), 0.5, np.float32)),
        "reshape-through-elementwise",
        {"Mul": 1, "Reshape": 1},
        passes=dce,
        **late,
    )
    details = refused(scaled(np.arange(8, dtype=np.float32)), "reshape-through-elementwise", **late)
    assert "not a scalar" in " ".join(details["near_misses"]["shape"])
    refused(scaled(np.full((1, 1), 0.5, np.float32)), "reshape-through-elementwise")  # not late: not run


def test_unsqueeze_pairs_merge() -> None:
    proto = model(
        [node("Unsqueeze", ["x", "a1"], "u"), node("Unsqueeze", ["u", "a2"], "y")],
        [info("x", ["b", "s"])],
        ["y"],
        [init("a1", np.array([1], np.int64)), init("a2", np.array([0, 3], np.int64))],
    )
    fires(proto, "unsqueeze-unsqueeze", {"Unsqueeze": 1})


def test_an_unsqueeze_read_by_unsqueezes_only_goes_into_each() -> None:
    # a causal mask's row and column indices: arange[None, None, :, None] and arange[None, None, None, :]
    def fanned(other: str) -> onnx.ModelProto:
        return model(
            [
                node("Unsqueeze", ["x", "a01"], "u"),
                node("Unsqueeze", ["u", "a3"], "rows"),
                node(other, ["u", "a2"] if other == "Unsqueeze" else ["u"], "cols"),
            ],
            [info("x", ["s"])],
            ["rows", "cols"],
            [init(f"a{''.join(map(str, a))}", np.array(a, np.int64)) for a in ([0, 1], [3], [2])],
        )

    fires(fanned("Unsqueeze"), "unsqueeze-unsqueeze", {"Unsqueeze": 2})
    # three in a chain, the first two read twice (llama_ts's positions): each outer one takes x as it is by then
    tree = model(
        [
            node("Unsqueeze", ["x", "a0"], "u0"),
            node("Unsqueeze", ["u0", "a0"], "u1"),
            node("Unsqueeze", ["u0", "a2"], "y0"),
            node("Unsqueeze", ["u1", "a0"], "y1"),
            node("Unsqueeze", ["u1", "a3"], "y2"),
        ],
        [info("x", ["s"])],
        ["y0", "y1", "y2"],
        [init(f"a{a}", np.array([a], np.int64)) for a in (0, 2, 3)],
    )
    fires(tree, "unsqueeze-unsqueeze", {"Unsqueeze": 3})
    details = refused(fanned("Relu"), "unsqueeze-unsqueeze")
    assert "'u' is also read by" in " ".join(details["near_misses"]["shape"])


def test_the_mpt_exports_causal_mask_indices_take_one_unsqueeze_each() -> None:
    proto = onnx.load(str(FIXTURES / "mpt_dynamo.onnx"))
    out, details = fuse(proto)
    # arange[None, None] read as rows and as columns goes into both; one other pair merged before too
    assert details["applied"]["unsqueeze-unsqueeze"] == 3
    assert (ops(proto)["Unsqueeze"], ops(out)["Unsqueeze"]) == (7, 5)
    assert_same_outputs(proto, out, fixture_inputs(proto), rtol=1e-4, atol=1e-4)


def test_lossless_cast_chains_collapse_and_lossy_ones_stay() -> None:
    def chain(source: int, middle: int) -> onnx.ModelProto:
        return model(
            [node("Cast", ["x"], "c", to=middle), node("Cast", ["c"], "d", to=source), node("Neg", ["d"], "y")],
            [info("x", [2, 3], source)],
            [info("y", None, source)],
        )

    fires(chain(TensorProto.FLOAT16, TensorProto.FLOAT), "cast-chain", {"Neg": 1})
    details = refused(chain(TensorProto.FLOAT, TensorProto.FLOAT16), "cast-chain")
    assert "may lose values" in details["near_misses"]["shape"][0]


def test_a_computed_reshape_target_with_one_unknown_entry_becomes_a_constant() -> None:
    fires(computed_reshape([4]), "reshape-one-unknown", {"Reshape": 1}, passes="shape-infer,fuse,dce")


def test_reshape_one_unknown_refusals() -> None:
    details = refused(computed_reshape([-1]), "reshape-one-unknown")
    assert "more than one entry" in " ".join(details["near_misses"]["shape"])
    refused(computed_reshape([4], allowzero=1), "reshape-one-unknown")


def test_reshape_through_elementwise_takes_onnxruntimes_gelu() -> None:
    """At --target ort the TorchScript export's erf GELU becomes com.microsoft Gelu, element-wise as well: the
    projections' Reshapes around it still cancel (Swin's MLPs: 8 Reshapes and their kernels fewer)."""
    settings = {"target": "ort", **LATE, "passes": "shape-infer,fuse,noop,dce"}
    out = fires(
        exported_mlp(**ERF_MLP), "reshape-through-elementwise", {"Reshape": 2, "Gemm": 2, "Gelu": 1}, **settings
    )
    assert {n.domain for n in out.graph.node if n.op_type == "Gelu"} == {"com.microsoft"}


def test_a_slice_read_by_slices_only_goes_into_each() -> None:
    # Swin's patch merging: x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2], each
    # exported as a Slice of rows then one of columns; the two row Slices are read twice.
    whole = np.iinfo(np.int64).max

    def merging(last: str = "Slice") -> onnx.ModelProto:
        """The four corners; ``last`` reads x[:, 1::2] for the fourth (a Slice of its columns, or another op)."""
        nodes = [node("Slice", ["x", f"s{row}", "e", "a1", "t"], f"r{row}") for row in (0, 1)]
        nodes += [
            node("Slice", [f"r{row}", f"s{col}", "e", "a2", "t"], f"p{row}{col}")
            for row, col in ((0, 0), (1, 0), (0, 1))
        ]
        nodes.append(node(last, ["r1", "s1", "e", "a2", "t"] if last == "Slice" else ["r1"], "p11"))
        corners = ["p00", "p10", "p01", "p11"] if last == "Slice" else ["p00", "p10", "p01"]
        nodes.append(node("Concat", corners, "y", axis=-1))
        bounds = {"s0": [0], "s1": [1], "e": [whole], "a1": [1], "a2": [2], "t": [2]}
        outputs = ["y"] if last == "Slice" else ["y", "p11"]
        return model(
            nodes, [info("x", ["b", 8, 8, 3])], outputs, [init(n, np.array(v, np.int64)) for n, v in bounds.items()]
        )

    proto = merging()
    out, details = fuse(proto)
    assert details["applied"]["slice-slice"] == 4
    assert (ops(proto)["Slice"], ops(out)["Slice"]) == (6, 4)
    assert_same_outputs(proto, out, make_feeds(proto), rtol=0, atol=0)
    # a reader that cannot take x[:, 1::2] in (a Relu of it) keeps that Slice and its other reader as written;
    # x[:, 0::2] still goes into both of its readers
    kept = merging("Relu")
    out, details = fuse(kept)
    assert (ops(kept)["Slice"], ops(out)["Slice"]) == (5, 4)
    assert "'r1' is also read by" in " ".join(details["near_misses"]["shape"])
    assert_same_outputs(kept, out, make_feeds(kept), rtol=0, atol=0)
