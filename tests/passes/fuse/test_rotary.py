"""The rotary rules' table: rotary embeddings. Each rule fires on its model and refuses its perturbations
(tests/passes/fuse/table.py says how); a rule newer than the exporter fixtures has its case on an export too, and
the family's own tests follow its table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
from onnx import numpy_helper

from tests.passes.fuse.table import (
    NO_GATE,
    At,
    Case,
    Exported,
    Perturb,
    at_opset,
    below,
    copied,
    set_shape,
    table_tests,
    target_opset,
    untyped_at,
)
from tests.passes.fuse_exported import Change, Found, constant_of
from tests.passes.fuse_models import HALF, rope_model, rope_variant_model


def _rope_q(**kwargs: Any) -> Callable[[], onnx.ModelProto]:
    """RoPE of q alone (with k too, k's rotation would fuse in every perturbed model)."""
    return lambda: rope_model(roped=("q",), **kwargs)


def _rope_variant_cases(ort: bool) -> dict[str, Case]:
    """The interleaved and partial rotary rules: full interleaved (GPT-J without rotary_dim),
    partial rotate-half (Phi, GPT-NeoX) and partial interleaved (GPT-J)."""
    opset, prefix = (18, "ort-") if ort else (23, "")
    # the caches (Cos, Sin of the frequencies; rotate half: of Concat(f, f), then its first half), the 3-D form's
    # Reshapes (pairs), onnxruntime's flattened caches and their row ids
    caches = {"Cos": 1, "Sin": 1}
    ort_ids = {"Reshape": 3, "Shape": 1, "ReduceProd": 1, "Range": 1} if ort else {}
    forms = {
        "interleaved": (True, False, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
        "partial": (False, True, {**caches, **ort_ids, "Concat": 1, "Slice": 2}),
        "interleaved-partial": (True, True, {**caches, **ort_ids, "Reshape": 5 if ort else 2}),
    }
    cases = {}
    for suffix, (interleaved, partial, kept) in forms.items():

        def build(i: bool = interleaved, p: bool = partial, **changes: int) -> Callable[[], onnx.ModelProto]:
            return lambda: rope_variant_model(i, p, opset, **changes)

        wrong = (
            Perturb(lambda _, b=build: b(rest_start=HALF + 1)(), "the rotated part is not", note="the rest starts late")
            if partial
            else Perturb(lambda _, b=build: b(odd_start=0)(), "not the even and odd", note="both Slices start at 0")
        )
        dynamic = ["b", "s", 2, "d"] if interleaved else ["b", 2, "s", "d"]
        cases[f"{prefix}rotary-embedding-{suffix}"] = Case(
            build(),
            {"RotaryEmbedding": 1, **kept},
            "q_neg",
            wrong,
            Perturb(set_shape("q", dynamic), "the rotated size is not static"),
            NO_GATE if ort else below(23),
            {"target": "ort"} if ort else {},
            passes="shape-infer,fuse,dce",
        )
    return cases


def _halves_swapped(found: Found) -> Change:
    """The rotation's two Slices read each other's bounds: x1 the second half, x2 the first."""

    def change(proto: onnx.ModelProto) -> onnx.ModelProto:
        out = copied(proto)
        slices = {n.output[0]: n for n in out.graph.node if n.output[0] in (found.names["x1"], found.names["x2"])}
        first, second = slices[found.names["x1"]], slices[found.names["x2"]]
        first.input[1:3], second.input[1:3] = list(second.input[1:3]), list(first.input[1:3])
        return out

    return change


def slice_start_at(binding: str, shift: int, reason: str, note: str) -> At:
    """The Slice bound to ``binding`` starts ``shift`` later, through a constant of its own (an exporter may share
    the start with other nodes)."""

    def change(found: Found) -> Change:
        def shifted(proto: onnx.ModelProto) -> onnx.ModelProto:
            out = copied(proto)
            sliced = next(n for n in out.graph.node if n.output[0] == found.names[binding])
            start = constant_of(out, sliced.input[1]) + shift
            out.graph.initializer.append(numpy_helper.from_array(start, f"{binding}_shifted_start"))
            sliced.input[1] = f"{binding}_shifted_start"
            return out

        return shifted

    return At(change, reason, note)


EVEN_ODD_ONE_START = slice_start_at("x2", -1, "not the even and odd", "the odd entries start at 0")
REST_STARTS_LATE = slice_start_at("rest", 1, "the rotated part is not", "the rest starts one later")


CASES: dict[str, Case] = {
    **_rope_variant_cases(ort=False),
    **_rope_variant_cases(ort=True),
    "rotary-embedding": Case(
        _rope_q(),
        {"RotaryEmbedding": 1},
        "q_neg",
        Perturb(lambda p: _rope_q(swapped=True)(), "not the two halves", note="the Slices' bounds swapped"),
        Perturb(set_shape("q", ["b", 2, "s", "d"]), "the rotated size is not static"),
        below(23),
        passes="shape-infer,fuse,dce",
    ),
    "ort-rotary-embedding": Case(
        lambda: at_opset(18)(_rope_q()()),
        {"RotaryEmbedding": 1},
        "q_neg",
        Perturb(
            lambda p: at_opset(18)(_rope_q(swapped=True)()), "not the two halves", note="the Slices' bounds swapped"
        ),
        Perturb(set_shape("q", ["b", 2, "s", "d"]), "the rotated size is not static"),
        NO_GATE,
        {"target": "ort"},
        passes="shape-infer,fuse,dce",
    ),
}

EXPORTED: dict[str, Exported | str] = {
    "ort-rotary-embedding": Exported(
        ("llama_dynamo", "llama_ts"),
        {"RotaryEmbedding": 1},
        At(_halves_swapped, "not the two halves", "the two Slices' bounds swapped"),
        untyped_at(("x",), "not a 4-D float32 or float16 tensor"),
        NO_GATE,
        {"target": "ort"},
    ),
    **{
        f"{prefix}rotary-embedding-{suffix}": Exported(
            fixtures,
            {"RotaryEmbedding": 1},
            wrong,
            untyped_at(("x",), "not a 4-D float32 or float16 tensor"),
            gate,
            settings,
        )
        for prefix, gate, settings in (
            ("ort-", NO_GATE, {"target": "ort"}),
            ("", target_opset(22, "needs opset >= 23"), {"target_opset": 23}),
        )
        for suffix, fixtures, wrong in (
            ("interleaved", ("gptj_dynamo", "gptj_ts"), EVEN_ODD_ONE_START),
            ("partial", ("phi_dynamo", "phi_ts"), REST_STARTS_LATE),
            ("interleaved-partial", ("gptj_dynamo", "gptj_ts"), REST_STARTS_LATE),
        )
    },
}

# This family's rules older than the exporter fixtures (d2e82f6): their cases are built here. One of them
# gains an exporter case by moving to EXPORTED; a newer rule has its entry there (test_contract.py).
BEFORE_EXPORTS: frozenset[str] = frozenset(
    {
        "rotary-embedding",
    }
)

# test_the_rule_fires_on_its_model and the other table tests, over this family's table
globals().update(table_tests(CASES, EXPORTED))
