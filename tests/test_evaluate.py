"""The constant-subgraph evaluator: numpy kernels agree with onnxruntime, regions of other
ops run in one onnxruntime session, and what must not be evaluated is refused."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import helper, numpy_helper

from graphopt.evaluate import EvaluationError, Evaluator
from graphopt.ir import Attr, AttrKind, DataType, Graph, Node, Tensor, TensorType, Value
from tests.numerics import run_ort

I64_MAX = np.iinfo(np.int64).max


def f32(*values: Any) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def i64(*values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def i32(*values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def half(*values: Any) -> np.ndarray:
    return np.array(values, dtype=np.float16)


def ints(shape: Sequence[int], dtype: Any = np.int32) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) - 5).astype(dtype).reshape(shape)


def floats(shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    return np.linspace(-2.5, 3.5, int(np.prod(shape))).astype(dtype).reshape(shape)


def _ir_attr(name: str, value: Any) -> Attr:
    if isinstance(value, np.ndarray):
        return Attr(name, AttrKind.TENSOR, Tensor.from_array(value, name))
    if isinstance(value, (bool, int)):
        return Attr(name, AttrKind.INT, int(value))
    if isinstance(value, float):
        return Attr(name, AttrKind.FLOAT, value)
    if all(isinstance(v, int) for v in value):
        return Attr(name, AttrKind.INTS, list(value))
    return Attr(name, AttrKind.FLOATS, list(value))


def _onnx_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: numpy_helper.from_array(v, k) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}


def evaluate_node(
    op: str,
    arrays: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    opset: int,
    outputs: int = 1,
    evaluator: Evaluator | None = None,
) -> list[np.ndarray]:
    values = [None if a is None else Value(f"in{i}") for i, a in enumerate(arrays)]
    node = Node(op, values, [f"out{k}" for k in range(outputs)], [_ir_attr(k, v) for k, v in attrs.items()])
    feeds = {v: a for v, a in zip(values, arrays) if v is not None and a is not None}
    found = (evaluator or Evaluator()).evaluate([node], feeds, node.outputs, {"": opset})
    return [found[v] for v in node.outputs]


def onnxruntime_node(
    op: str, arrays: Sequence[np.ndarray | None], attrs: dict[str, Any], opset: int, outputs: int = 1
) -> list[np.ndarray]:
    names = ["" if a is None else f"in{i}" for i, a in enumerate(arrays)]
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, arrays)
        if a is not None
    ]
    results = [helper.make_value_info(f"out{k}", onnx.TypeProto()) for k in range(outputs)]
    node = helper.make_node(op, names, [r.name for r in results], **_onnx_attrs(attrs))
    model = helper.make_model(
        helper.make_graph([node], "g", inputs, results), opset_imports=[helper.make_opsetid("", opset)]
    )
    model.ir_version = 8
    found = run_ort(model.SerializeToString(), {n: a for n, a in zip(names, arrays) if a is not None})
    return [found[r.name] for r in results]


def assert_same(found: np.ndarray, expected: np.ndarray) -> None:
    assert found.dtype == expected.dtype
    assert found.shape == expected.shape
    if found.dtype.kind == "f":
        tolerance = 1e-3 if found.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(found, expected, rtol=tolerance, atol=tolerance, equal_nan=True)
    else:
        np.testing.assert_array_equal(found, expected)


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to leave the numpy kernels."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("expected a numpy kernel, not an onnxruntime session")

    monkeypatch.setattr("graphopt.evaluate.evaluator.run_region", refuse)


def case(op: str, inputs: Sequence[np.ndarray | None], attrs: dict[str, Any] | None = None, **kw: Any) -> Any:
    opset = kw.pop("opset", 21)
    outputs = kw.pop("outputs", 1)
    return pytest.param(op, list(inputs), attrs or {}, opset, outputs, id=kw.pop("id", op))


KERNEL_CASES = [
    case("Constant", [], {"value": floats([2, 3])}, id="Constant-tensor"),
    case("Constant", [], {"value_ints": [1, -2]}, id="Constant-ints"),
    case("Constant", [], {"value_float": 1.5}, id="Constant-float"),
    case("Identity", [ints([2, 2], np.int64)]),
    case("Cast", [f32(-1.7, 2.5, 3.9, -0.2)], {"to": int(DataType.INT32)}, id="Cast-truncates"),
    case("Cast", [i64(-3, 70000, 1)], {"to": int(DataType.FLOAT16)}, id="Cast-int-half"),
    case("Cast", [f32(0, 0.5, -1)], {"to": int(DataType.BOOL)}, id="Cast-bool"),
    case("Cast", [np.array([True, False])], {"to": int(DataType.FLOAT)}, id="Cast-from-bool"),
    case("Cast", [np.array([1e40, 0.1])], {"to": int(DataType.FLOAT)}, id="Cast-double-float"),
    case("CastLike", [f32(1.9, -1.9), i64(0)]),
    case("Shape", [floats([2, 3, 4])]),
    case("Shape", [floats([2, 3, 4])], {"start": -2, "end": -1}, id="Shape-negative"),
    case("Shape", [floats([2, 3, 4])], {"start": 1, "end": 10}, id="Shape-clamped"),
    case("Size", [floats([2, 0, 4])]),
    case("Reshape", [ints([2, 3, 4]), i64(0, -1)], id="Reshape-0-and-minus-1"),
    case("Reshape", [ints([2, 3, 4]), i64(4, -1, 2)], id="Reshape-minus-1"),
    case("Reshape", [ints([0, 3]), i64(0, 3)], {"allowzero": 1}, id="Reshape-allowzero"),
    case("Reshape", [ints([2, 0, 3]), i64(-1, 3)], id="Reshape-empty"),
    case("Flatten", [floats([2, 3, 4])], {"axis": 0}, id="Flatten-0"),
    case("Flatten", [floats([2, 3, 4])], {"axis": -1}, id="Flatten-negative"),
    case("Squeeze", [floats([1, 3, 1]), i64(-1)], id="Squeeze-input"),
    case("Squeeze", [floats([1, 3, 1])], {"axes": [0]}, opset=11, id="Squeeze-attr"),
    case("Squeeze", [floats([1, 3, 1])], id="Squeeze-all"),
    case("Unsqueeze", [floats([2, 3]), i64(0, -1)], id="Unsqueeze-input"),
    case("Unsqueeze", [floats([2, 3])], {"axes": [1]}, opset=11, id="Unsqueeze-attr"),
    case("Transpose", [floats([2, 3, 4])]),
    case("Transpose", [floats([2, 3, 4])], {"perm": [1, 0, 2]}, id="Transpose-perm"),
    case("Concat", [ints([2, 3]), ints([2, 0]), ints([2, 1])], {"axis": -1}),
    case("Split", [floats([3, 4]), i64(1, 3)], {"axis": 1}, outputs=2, id="Split-input"),
    case("Split", [floats([5, 2])], {"num_outputs": 3}, opset=18, outputs=3, id="Split-uneven"),
    case("Split", [floats([4, 2])], {"split": [3, 1]}, opset=11, outputs=2, id="Split-attr"),
    case("Split", [floats([2, 6])], {"axis": -1}, opset=13, outputs=3, id="Split-equal"),
    case("Gather", [floats([3, 4]), i64([-1, 0], [2, 1])], {"axis": 1}),
    case("Gather", [floats([3, 4]), np.array(-2, np.int64)], id="Gather-scalar"),
    case("Gather", [ints([3]), i32(2, 0)], id="Gather-int32"),
    case("GatherElements", [floats([3, 4]), i64([-1, 0], [2, 1])], {"axis": -1}),
    case("Slice", [ints([5, 4]), i64(-1), i64(-1000), i64(0), i64(-1)], id="Slice-negative-step"),
    case("Slice", [ints([5, 4]), i64(1, 0), i64(I64_MAX, 3), i64(-1, 0), i64(1, 2)], id="Slice-max-end"),
    case("Slice", [ints([5, 4]), i64(10), i64(-10), i64(0), i64(-2)], id="Slice-clamped-backward"),
    case("Slice", [ints([5, 4]), i64(3), i64(1)], id="Slice-empty"),
    case("Slice", [ints([5, 4])], {"starts": [1], "ends": [-1], "axes": [1]}, opset=9, id="Slice-attr"),
    case("Slice", [ints([0, 4]), i64(-1), i64(-5), i64(0), i64(-1)], id="Slice-of-empty"),
    case("Range", [np.array(0, np.int64), np.array(10, np.int64), np.array(3, np.int64)]),
    case("Range", [np.array(10, np.int32), np.array(0, np.int32), np.array(-3, np.int32)], id="Range-down"),
    case("Range", [np.array(5, np.int32), np.array(1, np.int32), np.array(1, np.int32)], id="Range-empty"),
    case("Range", [np.array(0.1, np.float32), np.array(10, np.float32), np.array(0.1, np.float32)], id="Range-f"),
    case("ConstantOfShape", [i64(2, 3)], {"value": i64(7)}),
    case("ConstantOfShape", [i64(0, 2)], id="ConstantOfShape-empty"),
    case("Expand", [floats([3, 1]), i64(2, 1, 4)]),
    case("Expand", [floats([3, 1]), i64(1)], id="Expand-smaller"),
    case("Tile", [ints([2, 3]), i64(2, 1)]),
    case("Where", [np.array([[True], [False]]), ints([1, 3]), ints([2, 1])]),
    case("Add", [ints([2, 3]), ints([3])]),
    case("Add", [floats([0, 3]), floats([1, 3])], id="Add-empty"),
    case("Sub", [floats([2, 3]), floats([2, 1])]),
    case("Mul", [ints([2, 3], np.int64), ints([1], np.int64)]),
    case("Div", [i32(-7, 7, -7, 7, -1, 5), i32(2, 2, -2, -2, 3, -3)], id="Div-int-truncates"),
    case("Div", [i64(-9, 9), i64(4, -4)], id="Div-int64"),
    case("Div", [floats([2, 3]), f32(0.5, -2, 0)], id="Div-float"),
    case("Mod", [i32(-7, 7, -7, 7), i32(2, 2, -2, -2)], id="Mod-int"),
    case("Mod", [i32(-7, 7, -7, 7), i32(2, 2, -2, -2)], {"fmod": 1}, id="Mod-fmod"),
    case("Mod", [f32(-7.5, 7.5), f32(2, -2)], {"fmod": 1}, id="Mod-float"),
    case("Pow", [floats([2, 3]), f32(2)]),
    case("Pow", [i64(2, 3, -2), f32(0.5, 2.5, -1)], id="Pow-int-base"),
    case("Pow", [i32(2, 3, -2), i32(-1, 2, 3)], id="Pow-int-int"),
    case("Neg", [ints([2, 3])]),
    case("Abs", [floats([2, 3])]),
    case("Sign", [f32(-2, 0, 3)]),
    case("Sqrt", [f32(0, 2, 9)]),
    case("Exp", [floats([2, 3])]),
    case("Log", [f32(0.5, 1, 9)]),
    case("Reciprocal", [f32(0.5, -4, 3)]),
    case("Floor", [floats([2, 3])]),
    case("Ceil", [floats([2, 3])]),
    case("Round", [f32(0.5, 1.5, 2.5, -0.5, -1.7)]),
    case("Min", [ints([2, 3]), ints([3]), i32(0)]),
    case("Max", [floats([2, 3]), floats([1, 3])]),
    case("Sum", [floats([2, 3]), floats([3])]),
    case("Mean", [floats([2, 3]), floats([3]), f32(1)]),
    case("Equal", [i64(1, 2, 3), i64(2)]),
    case("Less", [floats([2, 3]), f32(0)]),
    case("Greater", [floats([2, 3]), f32(0)]),
    case("LessOrEqual", [i64(1, 2, 3), i64(2)]),
    case("GreaterOrEqual", [i64(1, 2, 3), i64(2)]),
    case("Not", [np.array([True, False])]),
    case("And", [np.array([True, False]), np.array([True])]),
    case("Or", [np.array([True, False]), np.array([False])]),
    case("Xor", [np.array([True, False]), np.array([True])]),
    case("BitwiseAnd", [ints([3]), i32(6)]),
    case("MatMul", [floats([2, 3]), floats([3, 4])]),
    case("MatMul", [floats([3]), floats([2, 3, 4])], id="MatMul-vector"),
    case("MatMul", [floats([2, 2, 3]), floats([3])], id="MatMul-vector-right"),
    case("MatMul", [ints([3, 2], np.int64), ints([2, 2], np.int64)], id="MatMul-int"),
    case("MatMul", [floats([2, 3], np.float16), floats([3, 2], np.float16)], id="MatMul-half"),
    case("MatMul", [floats([2, 0]), floats([0, 3])], id="MatMul-empty"),
    case("ReduceSum", [floats([2, 3, 4]), i64(-1)], {"keepdims": 0}),
    case("ReduceSum", [ints([2, 3])], {"axes": [0]}, opset=11, id="ReduceSum-attr"),
    case("ReduceSum", [ints([2, 3])], {"noop_with_empty_axes": 1}, id="ReduceSum-noop"),
    case("ReduceSum", [floats([2, 0])], id="ReduceSum-empty"),
    case("ReduceMean", [ints([2, 3]), i64(1)], id="ReduceMean-int"),
    case("ReduceMean", [floats([2, 3])], {"axes": [0], "keepdims": 0}, opset=13, id="ReduceMean-attr"),
    case("ReduceProd", [ints([2, 3], np.int64), i64(-2)]),
    case("ReduceMax", [floats([2, 3])], {"keepdims": 0}),
    case("ReduceMin", [ints([2, 3]), i64(0, 1)]),
    case("DequantizeLinear", [np.array([0, 3, 255], np.uint8), f32(0.5), np.array(3, np.uint8)]),
    case(
        "DequantizeLinear",
        [np.array([[-128, 5], [7, 127]], np.int8), f32(0.5, 0.25), np.array([1, -2], np.int8)],
        {"axis": 0},
        id="DequantizeLinear-per-axis",
    ),
    case("Dropout", [floats([2, 3])], outputs=2),
    # Half precision, NaN, other dtypes, empty tensors and scalars.
    case("Add", [floats([2, 3], np.float16), floats([3], np.float16)], id="Add-half"),
    case("Mean", [half(1, 2), half(2, 5)], id="Mean-half"),
    case("Exp", [half(0.5, 2, -3)], id="Exp-half"),
    case("Pow", [half(0.5, 2, 3), half(2.5)], id="Pow-half"),
    case("ReduceSum", [floats([2, 3], np.float16)], id="ReduceSum-half"),
    case("ReduceProd", [floats([3, 5], np.float16)], id="ReduceProd-half"),
    case("Sign", [f32(np.nan, -1, 0)], id="Sign-nan"),
    case("Min", [f32(np.nan, -1, 0), f32(1, np.nan, -1)], id="Min-nan"),
    case("Max", [f32(np.nan, -1, 0), f32(1, np.nan, -1)], id="Max-nan"),
    case("Range", [np.array(0.5), np.array(3.0), np.array(0.3)], id="Range-double"),
    case("Range", [np.array(1, np.int16), np.array(30, np.int16), np.array(7, np.int16)], id="Range-int16"),
    case("Split", [floats([4, 2])], {"num_outputs": 3}, opset=18, outputs=3, id="Split-last-empty"),
    case("DequantizeLinear", [np.array([0, 3, 255], np.uint8), half(0.5), np.array(3, np.uint8)], id="Deq-half"),
    case("DequantizeLinear", [i32(0, -3, 2**31 - 1), f32(0.5)], id="DequantizeLinear-int32"),
    case("Gather", [floats([3, 4]), np.zeros((0, 2), np.int64)], {"axis": 1}, id="Gather-no-indices"),
    case("Div", [i64(-(2**62), 2**62 + 1), i64(3, -7)], id="Div-int64-large"),
    case("MatMul", [ints([2, 3]), ints([3, 2])], id="MatMul-int32"),
    case("Abs", [i64(-3, 4)], id="Abs-int"),
    case("Neg", [np.array([1, -2], np.int8)], id="Neg-int8"),
    case("Tile", [ints([2, 0]), i64(3, 2)], id="Tile-empty"),
    case("Expand", [ints([0, 1]), i64(1, 4)], id="Expand-empty"),
    case("ConstantOfShape", [i64()], {"value": np.array([True])}, id="ConstantOfShape-scalar"),
    case("Unsqueeze", [np.array(3.0, np.float32), i64(0)], id="Unsqueeze-scalar"),
    case("Transpose", [np.array(3.0, np.float32)], id="Transpose-scalar"),
    case("Shape", [np.array(3.0, np.float32)], id="Shape-scalar"),
    case("Slice", [ints([5]), i64(-3), i64(-1)], id="Slice-defaults"),
    case("NonZero", [np.array([[1, 0], [0, 3]], np.int32)]),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "opset", "outputs"), KERNEL_CASES)
@pytest.mark.usefixtures("numpy_only")
def test_kernel_matches_onnxruntime(
    op: str, inputs: list[np.ndarray | None], attrs: dict[str, Any], opset: int, outputs: int
) -> None:
    found = evaluate_node(op, inputs, attrs, opset, outputs)
    expected = onnxruntime_node(op, inputs, attrs, opset, outputs)
    for got, want in zip(found, expected):
        assert_same(got, want)


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "opset"),
    [
        ("Reshape", [ints([2, 3]), i64(4, -1, -1)], {}, 21),
        ("Squeeze", [floats([2, 3]), i64(0)], {}, 21),
        ("Gather", [floats([3]), i64(3)], {}, 21),
        ("Div", [i32(1, 2), i32(1, 0)], {}, 21),
        ("Slice", [floats([3]), i64(0), i64(2), i64(0), i64(0)], {}, 21),
        ("Concat", [floats([2, 3]), floats([3, 3])], {"axis": 1}, 21),
    ],
)
@pytest.mark.usefixtures("numpy_only")
def test_invalid_input_is_an_error_naming_the_node(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], opset: int
) -> None:
    with pytest.raises(EvaluationError, match=f"{op} node producing 'out0'"):
        evaluate_node(op, inputs, attrs, opset)


BINARY_OPS = ["Add", "Sub", "Mul", "Div", "Min", "Max", "Equal", "Less", "GreaterOrEqual"]


@st.composite
def broadcast_operands(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    op = draw(st.sampled_from(BINARY_OPS))
    dtype = draw(st.sampled_from([np.int32, np.int64, np.float32]))
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, min_side=0, max_side=3))
    if np.dtype(dtype).kind == "i":
        elements = st.integers(-20, 20)
        divisors = st.integers(-20, 20).filter(bool)
    else:
        elements = st.floats(-10, 10, width=32)
        divisors = st.floats(0.25, 10, width=32)
    a = draw(hnp.arrays(dtype, shapes.input_shapes[0], elements=elements))
    b = draw(hnp.arrays(dtype, shapes.input_shapes[1], elements=divisors if op == "Div" else elements))
    return op, a, b


@settings(max_examples=60, deadline=None)
@given(broadcast_operands())
def test_broadcast_ops_match_onnxruntime(operands: tuple[str, np.ndarray, np.ndarray]) -> None:
    op, a, b = operands
    assert_same(evaluate_node(op, [a, b], {}, 21)[0], onnxruntime_node(op, [a, b], {}, 21)[0])


@settings(max_examples=30, deadline=None)
@given(hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), st.randoms())
def test_where_broadcasts_like_onnxruntime(shapes: Any, random: Any) -> None:
    rng = np.random.default_rng(random.randint(0, 2**32))
    condition = rng.random(shapes.input_shapes[0]) < 0.5
    x, y = (rng.standard_normal(s).astype(np.float32) for s in shapes.input_shapes[1:])
    inputs = [np.asarray(condition), x, y]
    assert_same(evaluate_node("Where", inputs, {}, 21)[0], onnxruntime_node("Where", inputs, {}, 21)[0])


BOUNDS = st.integers(-8, 8) | st.sampled_from([I64_MAX, -I64_MAX - 1])


@st.composite
def slices(draw: st.DrawFn) -> list[np.ndarray]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5))
    axes = draw(
        st.lists(
            st.integers(-len(shape), len(shape) - 1),
            min_size=1,
            max_size=len(shape),
            unique_by=lambda a: a % len(shape),
        )
    )
    count = len(axes)
    starts, ends = (draw(st.lists(BOUNDS, min_size=count, max_size=count)) for _ in range(2))
    steps = draw(st.lists(st.integers(-3, 3).filter(bool), min_size=count, max_size=count))
    return [ints(shape), i64(*starts), i64(*ends), i64(*axes), i64(*steps)]


@settings(max_examples=60, deadline=None)
@given(slices())
def test_slice_matches_onnxruntime(inputs: list[np.ndarray]) -> None:
    assert_same(evaluate_node("Slice", inputs, {}, 21)[0], onnxruntime_node("Slice", inputs, {}, 21)[0])


# -- regions ---------------------------------------------------------------------------


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """The model of every onnxruntime session asked for, in order (created or not)."""
    created: list[object] = []
    real = onnxruntime.InferenceSession

    def counting(model: Any, *args: Any, **kwargs: Any) -> object:
        created.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", counting)
    yield created


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(x).astype(x.dtype)


def test_region_of_other_ops_runs_in_one_session(sessions: list[object]) -> None:
    # x -> Mul -> Erf -> Reshape -> Erf -> Add; the kernel ops after the first Erf go with it.
    x = Value("x")
    two = Value("two", const=Tensor.from_array(f32(2.0)))
    shape = Value("shape", const=Tensor.from_array(i64(3, 2)))
    mul = Node("Mul", [x, two], ["doubled"])
    erf = Node("Erf", [mul.outputs[0]], ["erf"])
    reshape = Node("Reshape", [erf.outputs[0], shape], ["reshaped"])
    erf2 = Node("Erf", [reshape.outputs[0]], ["erf2"])
    add = Node("Add", [erf2.outputs[0], two], ["sum"])
    side = Node("Neg", [x], ["negated"])
    nodes = [add, erf2, side, reshape, erf, mul]
    data = floats([2, 3])
    found = Evaluator().evaluate(nodes, {x: data}, [add.outputs[0], side.outputs[0]], {"": 21})
    # Mul and Neg ran in numpy; the session holds what the first Erf leads to.
    (model,) = sessions
    assert [n.op_type for n in onnx.load_from_string(model).graph.node] == ["Erf", "Reshape", "Erf", "Add"]
    np.testing.assert_allclose(found[add.outputs[0]], _erf(_erf(data * 2).reshape(3, 2)) + 2, rtol=1e-6)
    assert_same(found[side.outputs[0]], -data)


def _float16_table(doubled: bool = False, typed: bool = True) -> tuple[np.ndarray, list[Node]]:
    """Cos(positions * frequencies) of float16 values, typed as shape inference types them (``typed``; else as a
    folded circuit leaves them, untyped); ``doubled``: the angles concatenated with themselves before the Cos
    (GPT-NeoX's ``cat(freqs, freqs).cos()``). Also the angles in float32."""
    half_type = TensorType(DataType.FLOAT16)
    positions = np.arange(2048, dtype=np.float16).reshape(-1, 1)
    frequencies = (1 / 10000 ** (np.arange(0, 32, 2) / 32)).astype(np.float16).reshape(1, -1)
    mul = Node(
        "Mul",
        [Value(name, half_type, Tensor.from_array(array)) for name, array in (("p", positions), ("f", frequencies))],
        ["angles"],
    )
    nodes = [mul]
    if doubled:
        nodes.append(Node("Concat", [mul.outputs[0], mul.outputs[0]], ["doubled"], attributes=[_ir_attr("axis", -1)]))
    nodes.append(Node("Cos", [nodes[-1].outputs[0]], ["table"]))
    for node in nodes if typed else ():
        node.outputs[0].type = half_type
    angles = positions.astype(np.float32) * frequencies.astype(np.float32)
    return np.concatenate([angles, angles], axis=-1) if doubled else angles, nodes


@pytest.mark.parametrize(
    ("doubled", "typed"), [(False, True), (True, True), (False, False)], ids=["direct", "through-concat", "untyped"]
)
def test_a_float16_chain_runs_in_onnxruntime_as_the_model_would(
    doubled: bool, typed: bool, sessions: list[object]
) -> None:
    """onnxruntime computes a chain of float16 arithmetic in float32 and rounds once at its end (a Concat between
    two of its ops too); numpy's Mul alone rounded the angles first (by up to 1 at 2048), and their cosines moved
    by up to 0.48."""
    angles, nodes = _float16_table(doubled, typed)
    found = Evaluator().evaluate(nodes, {}, nodes[-1].outputs, {"": 21})[nodes[-1].outputs[0]]
    (model,) = sessions
    assert [n.op_type for n in onnx.load_from_string(model).graph.node] == [n.op_type for n in nodes]
    assert found.dtype == np.float16
    assert_same(found, np.cos(angles).astype(np.float16))


def test_one_float16_op_stays_in_numpy(sessions: list[object]) -> None:
    """One op rounds its result in onnxruntime as numpy does: no session for it."""
    _, nodes = _float16_table()
    mul = nodes[0]
    found = Evaluator().evaluate([mul], {}, mul.outputs, {"": 21})[mul.outputs[0]]
    assert not sessions
    assert found.dtype == np.float16


def test_body_captures_reach_the_session(sessions: list[object]) -> None:
    x = Value("x")
    neg = Node("Neg", [x], ["negated"])
    then_out = Node("Identity", [neg.outputs[0]], ["then_out"])
    else_out = Node("Abs", [neg.outputs[0]], ["else_out"])
    branches = [
        Attr(name, AttrKind.GRAPH, Graph([], [body.outputs[0]], [body], name=name))
        for name, body in (("then_branch", then_out), ("else_branch", else_out))
    ]
    flag = Value("flag")
    choose = Node("If", [flag], ["chosen"], branches)
    graph = Graph([x, flag], choose.outputs, [neg, choose])
    uses_before = neg.outputs[0].uses()
    data = floats([4])
    for cond, expected in ((True, -data), (False, np.abs(data))):
        found = Evaluator().evaluate([choose, neg], {x: data, flag: np.array(cond)}, choose.outputs, {"": 21})
        assert_same(found[choose.outputs[0]], expected)
    assert len(sessions) == 2
    # The sub-model is a copy: the graph evaluated from is untouched.
    assert neg.outputs[0].uses() == uses_before
    assert all(attr.value.parent is choose for attr in branches)
    graph.verify()


def test_unnamed_values_get_names_in_the_sub_model() -> None:
    x = Value("")
    erf = Node("Erf", [x], 1)
    neg = Node("Neg", [erf.outputs[0]], 1)
    found = Evaluator().evaluate([erf, neg], {x: f32(0.5)}, neg.outputs, {"": 21})
    np.testing.assert_allclose(found[neg.outputs[0]], -_erf(f32(0.5)), rtol=1e-6)


def test_initializers_are_read_when_not_given() -> None:
    weight = Value("w", const=Tensor.from_array(floats([2, 3])))
    transpose = Node("Transpose", [weight], ["wt"])
    found = Evaluator().evaluate([transpose], {}, transpose.outputs, {"": 21})
    assert_same(found[transpose.outputs[0]], floats([2, 3]).T)


def test_contrib_op_with_an_onnxruntime_kernel_is_evaluated() -> None:
    x = Value("x")
    gelu = Node("Gelu", [x], ["y"], domain="com.microsoft")
    opsets = {"": 17, "com.microsoft": 1}
    evaluator = Evaluator()
    assert evaluator.can_evaluate(gelu, opsets)
    assert not evaluator.can_evaluate(gelu, {"": 17})
    data = floats([5])
    found = evaluator.evaluate([gelu], {x: data}, gelu.outputs, opsets)
    np.testing.assert_allclose(found[gelu.outputs[0]], data * (1 + _erf(data / np.sqrt(2))) / 2, rtol=1e-5)


@pytest.mark.parametrize("domain", ["custom.ops", "ai.onnx.ml"])
def test_op_of_a_domain_without_evaluator_is_never_evaluated(domain: str, sessions: list[object]) -> None:
    x = Value("x")
    node = Node("Identity", [x], ["y"], domain=domain, name="mystery")
    opsets = {"": 21, domain: 1}
    assert not Evaluator().can_evaluate(node, opsets)
    with pytest.raises(
        EvaluationError, match=f"Identity node 'mystery' cannot be evaluated: no evaluator for the domain '{domain}'"
    ):
        Evaluator().evaluate([node], {x: f32(1)}, node.outputs, opsets)
    assert sessions == []


@pytest.mark.parametrize(
    ("domain", "reason"),
    [("com.microsoft", "onnxruntime has no CPU kernel for it"), ("", "opset 21 of the standard domain has no op")],
)
def test_unknown_op_is_never_evaluated(domain: str, reason: str) -> None:
    node = Node("NoSuchOp", [], ["y"], domain=domain)
    opsets = {"": 21, "com.microsoft": 1}
    assert not Evaluator().can_evaluate(node, opsets)
    with pytest.raises(EvaluationError, match=reason):
        Evaluator().evaluate([node], {}, node.outputs, opsets)


def _training_flag(value: bool, *, as_initializer: bool) -> tuple[Value, list[Node]]:
    array = np.array(value)
    if as_initializer:
        return Value("training", const=Tensor.from_array(array)), []
    constant = Node("Constant", [], ["training"], [_ir_attr("value", array)])
    return constant.outputs[0], [constant]


def _random_body() -> Graph:
    random = Node("RandomNormal", [], ["r"], [_ir_attr("shape", [2])])
    return Graph([], random.outputs, [random])


@pytest.mark.parametrize(
    "make",
    [
        lambda: Node("RandomNormal", [], ["y"], [_ir_attr("shape", [2])]),
        lambda: Node("RandomUniformLike", [Value("x")], ["y"]),
        lambda: Node("Bernoulli", [Value("x")], ["y"]),
        lambda: Node("Multinomial", [Value("x")], ["y"]),
        lambda: Node("Dropout", [Value("x"), None, _training_flag(True, as_initializer=True)[0]], ["y"]),
        lambda: Node("Dropout", [Value("x"), None, Value("flag")], ["y"]),
        lambda: Node("If", [Value("c")], ["y"], [Attr("then_branch", AttrKind.GRAPH, _random_body())]),
    ],
    ids=["RandomNormal", "RandomUniformLike", "Bernoulli", "Multinomial", "Dropout-training", "Dropout-unknown", "If"],
)
def test_random_ops_are_refused(make: Any) -> None:
    node = make()
    assert not Evaluator().can_evaluate(node, {"": 21})
    with pytest.raises(EvaluationError, match="random"):
        Evaluator().evaluate([node], {}, node.outputs, {"": 21})


@pytest.mark.parametrize("as_initializer", [True, False])
def test_inference_dropout_is_evaluated(as_initializer: bool) -> None:
    flag, producers = _training_flag(False, as_initializer=as_initializer)
    x = Value("x")
    dropout = Node("Dropout", [x, None, flag], ["y"])
    assert Evaluator().can_evaluate(dropout, {"": 21})
    found = Evaluator().evaluate([dropout, *producers], {x: f32(1, 2)}, dropout.outputs, {"": 21})
    assert_same(found[dropout.outputs[0]], f32(1, 2))


def test_case_a_kernel_does_not_model_goes_to_onnxruntime(sessions: list[object]) -> None:
    inputs = [np.array([[1, -2, 3, 4]], np.int8), f32([0.5, 2]), np.array([[1, -1]], np.int8)]
    attrs = {"axis": 1, "block_size": 2}
    found = evaluate_node("DequantizeLinear", inputs, attrs, 21)
    assert len(sessions) == 1
    assert_same(found[0], onnxruntime_node("DequantizeLinear", inputs, attrs, 21)[0])


def test_onnx_reference_runs_what_onnxruntime_cannot(sessions: list[object]) -> None:
    # onnxruntime has no double Erf.
    x = Value("x")
    erf = Node("Erf", [x], ["y"])
    data = np.array([0.25, -1.5])
    found = Evaluator().evaluate([erf], {x: data}, erf.outputs, {"": 21})
    assert found[erf.outputs[0]].dtype == np.float64
    np.testing.assert_allclose(found[erf.outputs[0]], _erf(data), rtol=1e-6)
    assert len(sessions) == 1


def test_region_both_runtimes_reject_is_an_error() -> None:
    x, w = Value("x"), Value("w")
    conv = Node("Conv", [x, w], ["y"], name="conv")
    with pytest.raises(EvaluationError, match="Conv node 'conv': onnxruntime failed .* and so did onnx.reference"):
        Evaluator().evaluate([conv], {x: floats([1, 2, 4, 4]), w: floats([3, 5, 1, 1])}, conv.outputs, {"": 21})


# -- the byte budget -------------------------------------------------------------------


def test_budget_refuses_a_huge_expand_before_allocating() -> None:
    x = Value("x")
    expand = Node("Expand", [x, Value("shape", const=Tensor.from_array(i64(2**40)))], ["big"])
    with pytest.raises(EvaluationError, match="Expand node producing 'big'.*byte budget"):
        Evaluator().evaluate([expand], {x: f32(1)}, expand.outputs, {"": 21})
    # The same with a size numpy could allocate: the budget stops it, not the allocator.
    expand.set_input(1, Value("shape", const=Tensor.from_array(i64(16 << 20))))
    tracemalloc.start()
    try:
        with pytest.raises(EvaluationError, match="byte budget"):
            Evaluator(byte_budget=1 << 20).evaluate([expand], {x: f32(1)}, expand.outputs, {"": 21})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_budget_refuses_a_huge_expand_in_the_session(sessions: list[object]) -> None:
    x = Value("x")
    erf = Node("Erf", [x], ["erf"])
    expand = Node("Expand", [erf.outputs[0], Value("shape", const=Tensor.from_array(i64(2**40)))], ["big"])
    with pytest.raises(EvaluationError, match="region of 2 nodes.*budget"):
        Evaluator().evaluate([erf, expand], {x: f32(1)}, expand.outputs, {"": 21})
    assert sessions == []


def test_budget_refuses_declared_shapes_before_running(numpy_only: None) -> None:
    x = Value("x")
    neg = Node("Neg", [x], [Value("y", TensorType(DataType.FLOAT, (1 << 20, 1 << 20)))])
    with pytest.raises(EvaluationError, match="declared output shapes"):
        Evaluator().evaluate([neg], {x: f32(1)}, neg.outputs, {"": 21})


def test_budget_counts_what_the_region_produces() -> None:
    x = Value("x")
    first = Node("Neg", [x], ["a"])
    second = Node("Abs", [first.outputs[0]], ["b"])
    data = floats([256])  # 1 KiB a result
    assert Evaluator(byte_budget=2048).evaluate([first, second], {x: data}, second.outputs, {"": 21})
    with pytest.raises(EvaluationError, match="Abs node producing 'b'"):
        Evaluator(byte_budget=1500).evaluate([first, second], {x: data}, second.outputs, {"": 21})


# -- results ---------------------------------------------------------------------------


def test_results_are_read_only_and_inputs_keep_their_flags() -> None:
    x = Value("x")
    identity = Node("Identity", [x], ["y"])
    neg = Node("Neg", [x], ["z"])
    data = f32(1, 2)
    found = Evaluator().evaluate([identity, neg], {x: data}, [identity.outputs[0], neg.outputs[0], x], {"": 21})
    assert all(not array.flags.writeable for array in found.values())
    assert data.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        found[neg.outputs[0]][0] = 5


def test_missing_input_is_an_error() -> None:
    x = Value("x")
    neg = Node("Neg", [x], ["y"])
    with pytest.raises(EvaluationError, match="reads 'x'"):
        Evaluator().evaluate([neg], {}, neg.outputs, {"": 21})
