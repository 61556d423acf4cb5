"""Type rules for onnxruntime's com.microsoft ops, and the choice of rule table for a node.

Quantizers write these ops into the models people deploy (``MatMulNBits`` from the int4
quantizer, ``MatMulIntegerToFloat`` and ``DynamicQuantizeMatMul`` from dynamic int8), and the
fuse pass writes more of them at ``--target ort``. onnx's own inference knows none of them, so
without a rule every value downstream of one loses its dims, and each rewrite that must prove
a shape (the attention merge Reshape, the rotary cos cache, a norm's axis) stops there. The
rules follow the shapes in onnxruntime's ContribOperators.md; an output a rule does not
describe (an optional mean or a KV-cache ``present``) is left untyped.
"""

from __future__ import annotations

from graphopt.facts.op import Op, Shape, d_div, d_mul, registrar, tensor
from graphopt.facts.rules import (
    RULES,
    Outputs,
    Rule,
    broadcasting,
    concat,
    conv,
    gemm,
    global_pool,
    matmul_shape,
    pool,
    quantized_as,
    window_dims,
)
from graphopt.ir import CONTRIB_DOMAIN, DataType, Node, TensorType

__all__ = ["CONTRIB_RULES", "type_rule"]

CONTRIB_RULES: dict[str, Rule] = {}

rule = registrar(CONTRIB_RULES)


def type_rule(node: Node) -> Rule | None:
    """The type rule of ``node``'s op in its domain (None: no rule)."""
    if node.in_standard_domain:
        return RULES.get(node.op_type)
    if node.domain == CONTRIB_DOMAIN:
        return CONTRIB_RULES.get(node.op_type)
    return None


def _t(dtype: DataType | None, shape: Shape | None) -> TensorType | None:
    found = tensor(dtype, shape)
    return found if isinstance(found, TensorType) else None


# onnxruntime's QuantizeLinear and DequantizeLinear: the standard ops' contract, with 16-bit and 4-bit types
# below opset 21 (quantize_static's 16-bit QDQ writes them)
CONTRIB_RULES["QuantizeLinear"] = RULES["QuantizeLinear"]
CONTRIB_RULES["DequantizeLinear"] = RULES["DequantizeLinear"]


# The QOperator format's element-wise, pooling, Where, Concat and Gemm ops (their operands among scales and zero points:
# onnxruntime's ContribOperators.md).
CONTRIB_RULES["QLinearAdd"] = CONTRIB_RULES["QLinearMul"] = quantized_as(broadcasting, (0, 3), 7)
for _unary in ("QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax"):
    CONTRIB_RULES[_unary] = quantized_as(RULES["Sigmoid"], (0,), 4)  # x -> x


def _pooled_channels_last(op: Op) -> Outputs:
    """GlobalAveragePool over N, spatial ..., C: the spatial dims pooled to 1."""
    x = op.shape(0)
    return [_t(op.dtype(0), None if x is None or len(x) < 2 else (x[0],) + (1,) * (len(x) - 2) + (x[-1],))]


@rule("QLinearGlobalAveragePool")
def quantized_global_pool(op: Op) -> Outputs:
    return quantized_as(_pooled_channels_last if op.attr("channels_last", 0) else global_pool, (0,), 4)(op)


def _windowed_channels_last(op: Op) -> Outputs:
    """AveragePool over N, spatial ..., C."""
    x, kernel = op.shape(0), op.attr("kernel_shape")
    if x is None or len(x) < 3 or not kernel:
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), (x[0], *window_dims(op, x[1:-1], kernel), x[-1]))]


@rule("QLinearAveragePool")
def quantized_pool(op: Op) -> Outputs:
    return quantized_as(_windowed_channels_last if op.attr("channels_last", 0) else pool, (0,), 4)(op)


# Where(condition, X, Y) with X, Y and Z each quantized: condition 0, X 1, Y 4, Z's zero point 8.
CONTRIB_RULES["QLinearWhere"] = quantized_as(RULES["Where"], (0, 1, 4), 8)


@rule("QLinearConcat")
def quantized_concat(op: Op) -> Outputs:
    """Y's scale and zero point, then each part as (X, its scale, its zero point)."""
    return quantized_as(concat, tuple(range(2, op.n_inputs, 3)), 1)(op)


# Gemm of A (0) and B (3); Y is float without its zero point (8), as onnxruntime's kernel writes it.
CONTRIB_RULES["QGemm"] = quantized_as(gemm, (0, 3), 8, unquantized=DataType.FLOAT)


# x -> x (the bias or skip inputs broadcast into x)
@rule("BiasGelu", "FastGelu", "Gelu", "QuickGelu", "RotaryEmbedding")
def same_as_first(op: Op) -> Outputs:
    return [op.type(0)]


# Y, then mean and inverse std dev (untyped), then the sum input + skip (+ bias) it normalized.
@rule("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
def skip_norm(op: Op) -> Outputs:
    return [op.type(0), None, None, op.type(0)]


@rule("FusedConv")
def fused_conv(op: Op) -> Outputs:
    return conv(op)


@rule("FusedGemm")
def fused_gemm(op: Op) -> Outputs:
    return gemm(op)


@rule("FusedMatMul")
def fused_matmul(op: Op) -> Outputs:
    """MatMul of the operands with their last two dims swapped where transA / transB say."""
    a, b = op.shape(0), op.shape(1)
    if op.attr("transBatchA", 0) or op.attr("transBatchB", 0) or a is None or b is None or len(a) < 2 or len(b) < 2:
        return [_t(op.dtype(0), None)]
    if op.attr("transA", 0):
        a = (*a[:-2], a[-1], a[-2])
    if op.attr("transB", 0):
        b = (*b[:-2], b[-1], b[-2])
    return [_t(op.dtype(0), matmul_shape(a, b))]


@rule("MatMulNBits")
def matmul_nbits(op: Op) -> Outputs:
    """A (..., K) times the K x N weight stored as blocks of n-bit ints: (..., N), A's type."""
    a, n = op.shape(0), op.attr("N", 0)
    if a is None or not a or n <= 0:
        return [_t(op.dtype(0), None)]
    return [_t(op.dtype(0), (*a[:-1], n))]


@rule("GatherBlockQuantized")
def gather_block_quantized(op: Op) -> Outputs:
    """Gather of a table stored as blocks of n-bit ints (int4 or uint4, or uint8 packing 8 / bits of them along the
    last axis): the table's dims with the gathered axis replaced by the indices', in the scales' type (index 2)."""
    table, indices = op.shape(0), op.shape(1)
    if not table or indices is None:
        return [_t(op.dtype(2), None)]
    axis = op.attr("gather_axis", 0) % len(table)
    bits = op.attr("bits", 4)
    if op.dtype(0) == DataType.UINT8 and bits in (2, 4, 8):
        table = (*table[:-1], d_mul(table[-1], 8 // bits))
    return [_t(op.dtype(2), (*table[:axis], *indices, *table[axis + 1 :]))]


# MatMul(A, B) of the integer operands, in the float type of the scale input (index 2).
@rule("DynamicQuantizeMatMul", "MatMulIntegerToFloat")
def integer_matmul_to_float(op: Op) -> Outputs:
    return [_t(op.dtype(2), matmul_shape(op.shape(0), op.shape(1)))]


def _presents(op: Op) -> Outputs:
    """An attention op's present key and value: the query's type, their shape left unknown."""
    return [_t(op.dtype(0), None)] * 2


@rule("MultiHeadAttention")
def multi_head_attention(op: Op) -> Outputs:
    """output (batch, q seq, v hidden): v hidden from a 3-D value (B, L, v hidden) or a 4-D
    one (B, heads, L, v head size); present key and value of the query's type, their shape left unknown."""
    q, v = op.shape(0), op.shape(2)
    presents = _presents(op)
    if q is None or len(q) != 3:
        return [_t(op.dtype(0), None), *presents]
    hidden = None
    if v is not None and len(v) == 3:
        hidden = v[2]
    elif v is not None and len(v) == 4:
        hidden = d_mul(v[1], v[3])
    return [_t(op.dtype(0), (q[0], q[1], hidden)), *presents]


@rule("GroupQueryAttention")
def group_query_attention(op: Op) -> Outputs:
    """output (batch, seq, heads * head size): the query's hidden size, or from packed QKV
    (key absent) hidden / (heads + 2 kv heads) * heads; present key and value of the query's type, their
    shape left unknown."""
    q = op.shape(0)
    presents = _presents(op)
    if q is None or len(q) != 3:
        return [_t(op.dtype(0), None), *presents]
    if op.input(1) is not None:
        return [_t(op.dtype(0), q), *presents]
    heads, kv_heads = op.attr("num_heads", 0), op.attr("kv_num_heads", 0)
    if heads <= 0 or kv_heads <= 0:
        return [_t(op.dtype(0), (q[0], q[1], None)), *presents]
    return [_t(op.dtype(0), (q[0], q[1], d_mul(d_div(q[2], heads + 2 * kv_heads), heads))), *presents]


@rule("Attention")
def packed_attention(op: Op) -> Outputs:
    """output (batch, seq, v hidden) of the packed-weights Attention: v hidden is the last of
    ``qkv_hidden_sizes``, else a third of the weights' columns; present left untyped."""
    x, w = op.shape(0), op.shape(1)
    if x is None or len(x) != 3:
        return [_t(op.dtype(0), None)]
    sizes = op.attr("qkv_hidden_sizes", [])
    hidden = sizes[2] if len(sizes) == 3 else (d_div(w[1], 3) if w is not None and len(w) == 2 else None)
    return [_t(op.dtype(0), (x[0], x[1], hidden))]


@rule("EmbedLayerNormalization")
def embed_layer_norm(op: Op) -> Outputs:
    """output (batch, seq, hidden) from the ids and the word table (vocab, hidden); mask_index
    int32 (batch,); the optional embedding sum as the output."""
    ids, table = op.shape(0), op.shape(2)
    if ids is None or len(ids) != 2:
        return [_t(op.dtype(2), None)]
    hidden = table[1] if table is not None and len(table) == 2 else None
    out = _t(op.dtype(2), (ids[0], ids[1], hidden))
    return [out, _t(DataType.INT32, (ids[0],)), out]
