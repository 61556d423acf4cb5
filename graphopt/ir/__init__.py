"""graphopt's intermediate representation: models, graphs, nodes, values, types, dims."""

from graphopt.ir.dims import Dim, Expr, FloorDiv, Sym, add, floordiv, mul, parse_dim, sub
from graphopt.ir.graph import Graph, GraphError
from graphopt.ir.model import Function, Model
from graphopt.ir.node import CONTRIB_DOMAIN, QDQ_DOMAINS, Attr, AttrKind, Node
from graphopt.ir.tensor import ArraySource, ExternalSource, SparseTensor, Tensor, TensorSource
from graphopt.ir.types import (
    DataType,
    MapType,
    OpaqueType,
    OptionalType,
    SequenceType,
    SparseTensorType,
    TensorType,
    Type,
)
from graphopt.ir.value import Use, Value, tensor_dtype, tensor_shape

__all__ = [
    "CONTRIB_DOMAIN",
    "QDQ_DOMAINS",
    "ArraySource",
    "Attr",
    "AttrKind",
    "DataType",
    "Dim",
    "Expr",
    "ExternalSource",
    "FloorDiv",
    "Function",
    "Graph",
    "GraphError",
    "MapType",
    "Model",
    "Node",
    "OpaqueType",
    "OptionalType",
    "SequenceType",
    "SparseTensor",
    "SparseTensorType",
    "Sym",
    "Tensor",
    "TensorSource",
    "TensorType",
    "Type",
    "Use",
    "Value",
    "add",
    "floordiv",
    "mul",
    "parse_dim",
    "sub",
    "tensor_dtype",
    "tensor_shape",
]
