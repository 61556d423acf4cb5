"""The ``strip-value-info`` pass: the written model declares the intermediate types its input did.

Inferred types serve the passes; in the output file they are a cost as often as a help.
onnxruntime infers them again at session start, and where a file declares them it applies
fusions it otherwise skips: on corpus/bert_small.onnx, with graphopt's value_info written,
it fuses eight SkipLayerNormalization nodes and runs 1.16x slower on one CPU thread than
without them (measured at ORT_ENABLE_ALL, batch 1, sequence 64).

So an intermediate value keeps the type the loaded file declared for it (its value_info) where
that declaration still holds, and no other. onnxruntime plans which buffers to reuse from the
declared shapes, and where the written file proves other sizes equal than its input did, the
plan changes with it: a stripped TorchScript export (which names each layer's unknown batch dim
apart, ``unk__78``) had every layer's batch proven the same and more buffers reused, and every
kernel ran slower. The float16 ViT TorchScript export (onnxruntime's float16 converter), written
stripped, ran 1.025 of the export's time, 0.95 with onnxruntime's buffer reuse turned off, and
0.982 written with the export's declarations; whisper_encoder_ts_fp16 1.041 -> 0.985. Over the
99 outputs of 33 reduced-precision exports and 42 of 14 float32 ones (three targets, ORT_ENABLE_ALL,
1 thread, 30 paired rounds on one machine), 19 ran faster beyond noise and 6 slower (the float16
dynamo ViT's default output 0.945 -> 0.960 of its variant: its declarations prove more equal than
onnxruntime's own inference does); the geometric mean of the new times over the old, 0.979 and
0.987. The runtime plans the values the output keeps as it planned them in the input, so what a
user measures is the graph's change. A model that declares nothing is written as before.

The declaration travels with the value (``Value.declared``), so a pass that changes a value's
layout in place, keeping its name, moves the declaration with its type, as the unwind pass does
when it permutes an output's axes; a declaration that no longer holds is simply not written.

Types of values produced by ops outside the standard domain stay: no runtime can infer
what a custom op returns. Graph inputs and outputs always keep their types.

The types of a Softmax's input and output stay too, where the file declared none: onnxruntime's
CPU Softmax may run in place (MayInplace), which its allocation planner allows only where the
declared shapes prove input and output the same size, and what it infers itself leaves unknown
dims unnamed. Without them each Softmax wrote a buffer of its own: on a diffusers-style UNet
(batch dynamic, 32x32 latents, 8 attentions; ORT_ENABLE_ALL, 1 thread) the Softmax nodes took
1.7x as long, and the model ran 0.98 of the export's time where with them it runs 0.90, as
onnxsim's output (which keeps every type) does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from graphopt.ir import Model, Node, TensorType, Type, Value
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register

__all__ = ["StripValueInfo", "declaration_holds", "written_types"]


# Ops onnxruntime's CPU kernels may run in place where the declared shapes prove it (see the docstring).
IN_PLACE = frozenset({"Softmax"})


def _in_place(node: Node) -> bool:
    return node.op_type in IN_PLACE and node.in_standard_domain


def declaration_holds(declared: Type | None, found: Type | None) -> bool:
    """``declared`` (what the loaded file said) still holds of a value graphopt types as ``found``:
    the same element type, and every dim the declaration fixes fixed alike."""
    if declared is None or found is None:
        return False
    if not isinstance(declared, TensorType) or not isinstance(found, TensorType):
        return declared == found
    if declared.dtype != found.dtype:
        return False
    if declared.shape is None:
        return True
    if found.shape is None or len(found.shape) != len(declared.shape):
        return False
    return all(not isinstance(said, int) or said == dim for said, dim in zip(declared.shape, found.shape, strict=True))


def written_types(model: Model, *, keep_custom: bool = True) -> Iterator[tuple[Value, Type | None]]:
    """Each typed intermediate value the pass rewrites, with the type the written model declares
    for it: the loaded file's declaration where it holds, else none (a reload reads it back so)."""
    for graph in model.all_graphs():
        for node in graph:
            if keep_custom and not node.in_standard_domain:
                continue
            for value in node.outputs:
                if value.type is None or value.is_graph_output:
                    continue
                if declaration_holds(value.declared, value.type):
                    yield value, value.declared
                elif not _in_place(node) and not any(_in_place(use.node) for use in value.uses()):
                    yield value, None


@register
class StripValueInfo(Pass, name="strip-value-info"):
    """Write only the intermediate types the input declared, where they still hold (runtimes re-infer the rest)"""

    @dataclass
    class Options:
        keep_custom: bool = option(True, "keep the types of outputs of ops outside the standard domain")

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        counts = {"stripped": 0, "as_declared": 0}
        changed = False
        for value, written in list(written_types(model, keep_custom=self.options.keep_custom)):
            changed = changed or value.type != written
            value.type = written
            counts["stripped" if written is None else "as_declared"] += 1
        return PassResult(changed, counts)
