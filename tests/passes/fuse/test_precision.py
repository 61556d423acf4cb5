"""The table's cases at the precisions deployed models have: every rule that fires on a float16, a statically
quantized (QDQ), a dynamically quantized (int8) or an int4-weight copy of a real export also fires on its case made
so (onnxruntime's float16 converter, every float value float16; quantize_static; quantize_dynamic; MatMulNBits
weights), and each of the case's perturbations, made in float32 and then converted, refuses it there too, naming the
same reason (or the one REASONS has where Q/DQ changes it). A float16 model's outputs keep their values within
float16's rounding (FLOAT16_TOLERANCE); a refused statically quantized model keeps every scale and zero point; a
quantized model's outputs are no further from the float model than before.

FLOAT16, QDQ, DYN8 and INT4 list the rules that fire on the variants of the real exports at those precisions (float16
with float32 inputs and outputs, QDQ int8, quantize_dynamic's int8, MatMulNBits' int4, of the 56 architectures'
exports from both exporters; default, --target ort and --target-opset 23: ``benchmarks/precision_variants.py rules``
lists them against this table): None where the case runs at that precision, a Case where the variants' spelling
needs one of its own (the rotary rules' caches computed at run time), QUANTIZER_LEAVES_IT where the weight quantizer
leaves the case as it is (checked), else why it does not. The rules of test_through_qdq's families fire through Q/DQ
there; here they meet the perturbations.
"""

from __future__ import annotations

import importlib

from tests.passes.fuse import test_rotary, test_through_qdq
from tests.passes.fuse.table import QUANTIZER_LEAVES_IT, Case, NamesType, precision_tests

# The families of the rules named below (each family's test file holds its CASES).
FAMILIES = ("activation", "arith", "attention", "conv", "embed", "gather", "matmul", "norm", "qdq", "rotary", "shape")
CASES: dict[str, Case] = {
    name: case
    for family in FAMILIES
    for name, case in importlib.import_module(f"tests.passes.fuse.test_{family}").CASES.items()
}
# test_through_qdq's cases: the rule fires through Q/DQ there.
THROUGH_QDQ = {
    n for cases in test_through_qdq.FAMILIES.values() for n in cases if n not in test_through_qdq.NOT_THROUGH_QDQ
}

# A rule not marked through_qdq fires in a quantized model only where no pair is inside its pattern.
NO_PAIR_INSIDE = (
    "n/a: not a rule that sees through Q/DQ; it fires on the QDQ variants where no pair is inside its pattern "
    "(an int64 mask's Unsqueezes, gpt2's Reshapes of unquantized values), and quantize_static leaves its case "
    "unquantized: its QDQ case is its float32 case"
)
# The rules that fire on both the float16 and the QDQ variants (their cases run at both precisions).
BOTH = (
    "attention-4d",
    "attention-heads-3d",
    "gelu-none",
    "gelu-tanh",
    "ort-biasgelu",
    "ort-fastgelu",
    "ort-gelu",
    "ort-multihead-attention",
    "ort-quickgelu",
    "ort-rmsnorm",
    "rmsnorm",
)
FUSED_KERNELS = NamesType("onnxruntime's fused kernels are float32 only")
FUSED_MATMUL = (
    "ort-fusedmatmul-mul",
    "ort-fusedmatmul-div",
    "ort-transpose-into-matmul-a",
    "ort-transpose-into-matmul-b",
)
PROJECTION = NamesType("not a float32 MatMul (measured on float32 only)")
DYNAMIC_INT8 = "n/a: DynamicQuantizeLinear takes float32 only: the case made float16 is no valid model"
FLOAT16: dict[str, str | NamesType | Case | None] = {
    **dict.fromkeys(BOTH),
    **dict.fromkeys(
        (
            "attention-float32",
            "rmsnorm-float32",
            "rotary-embedding-float32",
            "mha-float32",
            "gqa-float32",
            "gelu-float32",
            "softmax-float32",
            "logsoftmax-float32",
            "matmul-scales-joined",
            "ort-gelu-float32",
            "ort-fastgelu-float32",
            "ort-rmsnorm-float32",
        ),
        "n/a: its case is a float16 model already",
    ),
    **dict.fromkeys(
        ("float32-island", "float32-island-moved"),
        "n/a: its case is a float16 model already (a Cast to float16 and back)",
    ),
    "add-constant-row": None,
    "attention-kv-cache": None,
    "attention-merged-heads": None,
    "conv-mul": None,
    "div-mul-constants": None,
    "layernorm-residual-sum": None,
    "gather-consecutive-rows": None,
    "groupnorm-no-bias": None,
    "layout-chain-static": None,
    "mul-conv": None,
    "ort-group-query-attention": None,
    "ort-multihead-attention-merged": None,
    "ort-rotary-embedding": None,
    "ort-rotary-embedding-3d": None,
    "ort-rotary-embedding-interleaved-partial": None,
    "ort-rotary-embedding-partial": None,
    "pad-into-consumer": None,
    "reshape-chain": None,
    "reshape-transpose": None,
    # its case's Reshapes are matmul-add-gemm-projection's (gpt2's float16 Gemm carries them on the variant)
    "reshape-through-elementwise": NamesType("not a float32 MatMul", family="matmul"),
    "rotary-embedding": None,
    "rotary-embedding-interleaved-partial": None,
    "rotary-embedding-partial": None,
    "slice-slice": None,
    "transpose-transpose": None,
    "unsqueeze-unsqueeze": None,
    # Rules no float16 variant fires: each refuses its case made float16 and says the type.
    **dict.fromkeys(("ort-fusedconv", "ort-fusedconv-sum", "ort-fusedgemm"), FUSED_KERNELS),
    **dict.fromkeys(FUSED_MATMUL, NamesType("FusedMatMul is float32 only here")),
    **dict.fromkeys(("matmul-add-gemm-projection", "matmul-add-gemm-projection-reshaped"), PROJECTION),
    "tied-weight-gemm": NamesType("not a float32 MatMul (a float16 Gemm measured slower)"),
    **dict.fromkeys(("ort-dynamic-quantize-matmul", "ort-dynamic-quantize-matmul-bias"), DYNAMIC_INT8),
    "ort-embedlayernorm": NamesType("not float32 constants"),
    "ort-skiprmsnorm": NamesType("float16 SkipSimplifiedLayerNormalization rounds more"),
}
QDQ: dict[str, str | NamesType | Case | None] = {
    **dict.fromkeys(BOTH),
    "attention-merged-heads": None,
    "ort-multihead-attention-merged": None,
    "ort-rotary-embedding-partial": None,
    "rotary-embedding-partial": None,
    "gather-consecutive-rows": "in a test of its own: on the variants it fires after qdq-gather-table-uint8 moved "
    "the Gather before the table's DequantizeLinear, a new Q/DQ node, which this table's check forbids; "
    "test_gather.py's test_a_quantized_position_table_gives_its_consecutive_rows_by_a_slice fires it on its case "
    "quantized and refuses each perturbation",
    "qdq-gather-table-uint8": "n/a: its case is a quantized model already",
    "layernorm-residual-sum": "n/a: a Sum for an Add is no fused op, so it does not see through the pair between the "
    "Add and its norm (test_through_qdq.py shows the pair kept)",
    "layout-chain-static": NO_PAIR_INSIDE,
    "groupnorm-plain": None,
    "ort-rotary-embedding-3d": None,
    "ort-rotary-embedding-interleaved-partial": None,
    "ort-skiprmsnorm-decomposed": None,
    "rotary-embedding-interleaved-partial": None,
    "slice-slice": None,
    **test_rotary.RUNTIME_CACHES,
    "qdq-dequantize-after-move": "n/a: its case is a quantized model already",
    "qdq-requantize-same": "n/a: its case is a quantized model already",
    "unsqueeze-unsqueeze": NO_PAIR_INSIDE,
}
# The rules that fire on the dynamic int8 or int4 variants and whose cases hold no weight those quantizers take.
WEIGHTS_ELSEWHERE = (
    "attention-4d",
    "attention-heads-3d",
    "attention-merged-heads",
    "div-mul-constants",
    "gelu-none",
    "gelu-tanh",
    "groupnorm-no-bias",
    "layout-chain-static",
    "ort-fastgelu",
    "ort-fusedmatmul-mul",
    "ort-gelu",
    "ort-multihead-attention",
    "ort-multihead-attention-merged",
    "ort-quickgelu",
    "ort-rmsnorm",
    "ort-rotary-embedding-3d",
    "ort-rotary-embedding-interleaved-partial",
    "ort-rotary-embedding-partial",
    "reshape-chain",
    "reshape-transpose",
    "rmsnorm",
    "rotary-embedding-interleaved-partial",
    "rotary-embedding-partial",
    "slice-slice",
    "transpose-transpose",
    "unsqueeze-unsqueeze",
)
# The rules whose cases hold a MatMul by a constant weight, which both quantizers take: the case runs at both.
MATMUL_WEIGHTS = ("layernorm-residual-sum", "ort-group-query-attention", "ort-skiprmsnorm-decomposed")
FLOAT_GEMM = (
    "n/a: it moves Reshapes so that a float Gemm reads 2-D; the variants fire it on gpt2's Conv1D Gemms, which neither "
    "quantizer takes, and its case's MatMuls become integer MatMuls or MatMulNBits, which read 3-D and no rule "
    "makes Gemm"
)
DYN8: dict[str, str | NamesType | Case | None] = {
    **dict.fromkeys((*WEIGHTS_ELSEWHERE, "ort-biasgelu"), QUANTIZER_LEAVES_IT),
    **dict.fromkeys(MATMUL_WEIGHTS),
    "gather-consecutive-rows": None,  # quantize_dynamic quantizes the position table's Gather
    **dict.fromkeys(
        ("ort-dynamic-quantize-matmul", "ort-dynamic-quantize-matmul-bias"),
        "n/a: its case is a dynamically quantized model already",
    ),
    "attention-kv-cache": "n/a: its case holds an opset-23 Attention already, which quantize_dynamic takes for "
    "com.microsoft's Attention and writes as a QAttention; in the variants graphopt makes the Attention after the "
    "quantizer ran",
    **dict.fromkeys(
        ("rotary-embedding", "ort-rotary-embedding"),
        "n/a: the variants compute cos and sin at run time (test_rotary.RUNTIME_CACHES, which quantize_dynamic leaves "
        "float, as it leaves the float32 table's runs); its case gathers them from constant tables, which "
        "quantize_dynamic quantizes, and then the halves of cos are not proved equal: no variant has such tables",
    ),
    "reshape-through-elementwise": FLOAT_GEMM,
}
INT4: dict[str, str | NamesType | Case | None] = {
    **dict.fromkeys(
        (
            *WEIGHTS_ELSEWHERE,
            "add-constant-row",
            "attention-kv-cache",
            "conv-mul",
            "gather-consecutive-rows",
            "mul-conv",
            "ort-biasgelu",
            "ort-fusedconv",
            "ort-fusedconv-sum",
            "ort-rotary-embedding",
            "ort-transpose-into-matmul-b",
            "pad-into-consumer",
            "reshape-one-unknown",
            "rotary-embedding",
            "tied-weight-gemm",
        ),
        QUANTIZER_LEAVES_IT,
    ),
    **dict.fromkeys(MATMUL_WEIGHTS),
    "reshape-through-elementwise": FLOAT_GEMM,
}
# Each precision's declarations, by the name the table gives the precision.
DECLARED = {"float16": FLOAT16, "qdq": QDQ, "dyn8": DYN8, "int4": INT4}
# Where a perturbation refuses a rule through Q/DQ for another reason than in float32, by (precision, rule, kind).
REASONS: dict[tuple[str, str, str], str | None] = {
    # An interior value made a graph output keeps its pair whole (the output reads the float value): the pattern
    # does not see through it, so nothing matches and no near miss is said.
    **{("qdq", name, "output"): None for name, why in QDQ.items() if why is None or isinstance(why, Case)},
}


globals().update(precision_tests(CASES, DECLARED, THROUGH_QDQ, REASONS))
