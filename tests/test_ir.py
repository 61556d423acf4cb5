"""The IR: dims arithmetic, exact use lists under mutation, order, levels, captures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphopt.ir import (
    Attr,
    AttrKind,
    DataType,
    Expr,
    Graph,
    GraphError,
    Node,
    Sym,
    Tensor,
    TensorType,
    Value,
    add,
    floordiv,
    mul,
    parse_dim,
    sub,
)
from graphopt.ir.clone import clone_graph

batch, seq = Sym("batch"), Sym("seq")


def test_expressions_simplify() -> None:
    assert sub(add(seq, 1), 1) == seq
    assert add(mul(2, batch), batch) == mul(3, batch)
    assert sub(batch, batch) == 0
    assert floordiv(mul(4, seq), 2) == mul(2, seq)
    assert isinstance(floordiv(seq, 2), Expr)
    assert str(add(mul(2, seq), 1)) == "2*seq + 1"
    assert add(3, 4) == 7


def test_parse_keeps_spelling_and_names() -> None:
    assert parse_dim("batch") == batch
    parsed = parse_dim("seq+1")
    assert isinstance(parsed, Expr) and str(parsed) == "seq+1"
    assert parsed == add(seq, 1)
    assert parse_dim("batch size") == Sym("batch size")
    assert parse_dim("unk__12") == Sym("unk__12")


def test_independent_occurrences_differ() -> None:
    assert Sym("batch", 1) != Sym("batch", 2)
    assert sub(Sym("batch", 1), Sym("batch", 2)) != 0


@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(1, 9))
def test_arithmetic_matches_integers(a: int, b: int, d: int) -> None:
    # Substituting seq = a into the symbolic result gives the integer result.
    expr = add(mul(b, seq), a)
    assert sub(expr, mul(b, seq)) == a
    assert floordiv(mul(d, add(seq, a)), d) == add(seq, a)


def _chain() -> tuple[Graph, Value, Node, Node]:
    x = Value("x", TensorType(DataType.FLOAT, (batch, 4)))
    relu = Node("Relu", [x], ["r"])
    neg = Node("Neg", [relu.outputs[0]], ["y"])
    graph = Graph([x], [neg.outputs[0]], [relu, neg])
    return graph, x, relu, neg


def test_uses_follow_mutations() -> None:
    graph, x, relu, neg = _chain()
    r = relu.outputs[0]
    assert [u.node for u in r.uses()] == [neg]
    assert neg.outputs[0].is_graph_output
    neg.set_input(0, x)
    assert r.uses() == [] and len(x.uses()) == 2
    graph.remove(relu)
    assert [u.node for u in x.uses()] == [neg]
    graph.verify()


def test_replace_all_uses_leaves_graph_outputs_unless_asked() -> None:
    graph, _x, relu, neg = _chain()
    neg.outputs[0].replace_all_uses_with(relu.outputs[0])
    assert graph.outputs == [neg.outputs[0]]
    neg.outputs[0].replace_all_uses_with(relu.outputs[0], outputs=True)
    assert graph.outputs == [relu.outputs[0]]
    assert not neg.outputs[0].is_used()
    graph.remove(neg)
    graph.verify()


def test_safe_remove_refuses_used_values() -> None:
    graph, _, relu, _ = _chain()
    with pytest.raises(GraphError, match="still used"):
        graph.remove(relu)


def test_topological_order_and_levels() -> None:
    x = Value("x")
    a = Node("Relu", [x], ["a"])
    b = Node("Neg", [x], ["b"])
    c = Node("Add", [a.outputs[0], b.outputs[0]], ["c"])
    graph = Graph([x], [c.outputs[0]], [c, a, b])  # stored out of order
    assert graph.topological() == [a, b, c]
    assert graph.levels() == [[a, b], [c]]
    a.set_input(0, c.outputs[0])
    with pytest.raises(GraphError, match="cycle"):
        graph.topological()


def _if_node(outer: Value) -> tuple[Value, Node, Node]:
    inner = Node("Identity", [outer], ["inner_out"])
    then_branch = Graph([], [inner.outputs[0]], [inner], name="then")
    other = Node("Neg", [outer], ["other_out"])
    else_branch = Graph([], [other.outputs[0]], [other], name="else")
    cond = Value("cond", TensorType(DataType.BOOL, ()))
    node = Node(
        "If",
        [cond],
        ["y"],
        [Attr("then_branch", AttrKind.GRAPH, then_branch), Attr("else_branch", AttrKind.GRAPH, else_branch)],
    )
    return cond, node, inner


def test_captures_are_uses_and_order_dependencies() -> None:
    x = Value("x")
    producer = Node("Relu", [x], ["captured"])
    captured = producer.outputs[0]
    cond, if_node, inner = _if_node(captured)
    graph = Graph([x, cond], if_node.outputs, [if_node, producer])
    assert if_node.captures() == [captured]
    assert inner in [u.node for u in captured.uses()]
    assert graph.topological() == [producer, if_node]
    with pytest.raises(GraphError, match="still used"):
        graph.remove(producer)
    graph.remove(if_node, safe=False)
    assert captured.uses() == []


def test_clone_is_independent_and_shares_tensors() -> None:
    weight = Tensor.from_array(np.ones((2, 2), np.float32), "w")
    x = Value("x")
    w = Value("w", TensorType(DataType.FLOAT, (2, 2)), weight)
    mm = Node("MatMul", [x, w], ["y"])
    graph = Graph([x], [mm.outputs[0]], [mm], [w])
    copy = clone_graph(graph)
    copy.verify()
    (copy_node,) = copy.nodes
    assert copy_node is not mm and copy_node.inputs[1] is not w
    assert copy.initializers["w"].const is weight
    copy.remove(copy_node, safe=False)
    assert len(graph) == 1 and len(w.uses()) == 1


def test_verify_finds_duplicate_names() -> None:
    x = Value("x")
    a = Node("Relu", [x], ["t"])
    b = Node("Neg", [x], ["t"])
    graph = Graph([x], [b.outputs[0]], [a, b])
    with pytest.raises(GraphError, match="duplicate"):
        graph.verify()


def test_lazy_tensor_reads_on_demand() -> None:
    calls = []

    class Counting:
        def read(self) -> np.ndarray:
            calls.append(1)
            return np.zeros(3, np.float32)

    tensor = Tensor("t", DataType.FLOAT, (3,), Counting())
    assert tensor.nbytes == 12 and not calls
    tensor.numpy()
    assert calls == [1]
