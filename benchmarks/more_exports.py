"""More real exports: 46 architectures beyond the ten of ../shared/exports/build.py, exported by both of
PyTorch's exporters with that script's machinery (seeded random weights, dynamic batch and sequence, the same
index.json of bindings and input kinds), to measure graphopt's rules on graphs they were not written for.

    python benchmarks/more_exports.py [--out DIR] [--only NAME,...] [--exporters dynamo,ts]

Run it with the export environment ../shared/exports/build.py's docstring describes (torch, transformers, timm);
default DIR: ~/.cache/graphopt-more-exports, about 2.5 GB. Then, in graphopt's own environment:

    python benchmarks/exports.py --exports DIR          # default nodes against every peer, numerics
    python benchmarks/export_fusions.py --exports DIR --no-markdown   # fused ops, latency, issue 23's lines

Encoders (DistilBERT, RoBERTa, ALBERT, ELECTRA, MobileBERT, CLIP text), decoders (Mistral, Qwen2, Qwen3, Phi-3,
Gemma, GPT-NeoX, OPT, BLOOM, GPT-BigCode, StableLM, Falcon, MPT, CodeGen; Qwen2, Phi-3 and GPT-2 with a KV cache),
encoder-decoders (BART, mBART, T5), vision transformers (DeiT, Swin, BEiT, DINOv2, CLIP and SigLIP vision, SegFormer,
timm ViT, LeViT, MobileViT, MLP-Mixer, PoolFormer), audio (wav2vec 2.0) and CNNs (MobileNetV3/V4, RegNetY,
DenseNet-121, ConvNeXt-V2, EfficientNetV2, ResNet-50, GhostNet). Models are never stored in the repo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# ../shared/exports beside the repository (a clone elsewhere falls back to /work/shared).
for _shared in (Path(__file__).resolve().parents[2] / "shared/exports", Path("/work/shared/exports")):
    if (_shared / "build.py").is_file():
        sys.path.insert(0, str(_shared))
        break

import build  # noqa: E402
import torch  # noqa: E402
from build import LAYERS, VOCAB, H, KVDecoder, Tuple, image, text, timm_model  # noqa: E402


def dec_cfg(cls, **kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return cls(**base)


def causal(model_cls, cfg):
    return text(model_cls(cfg), ("input_ids", "attention_mask"), ("logits",), use_cache=False)


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    c = DistilBertConfig(vocab_size=VOCAB, dim=H, n_layers=LAYERS, n_heads=4, hidden_dim=4 * H)
    return text(DistilBertModel(c), ("input_ids", "attention_mask"), ("last_hidden_state",))


def roberta():
    from transformers import RobertaConfig, RobertaModel

    c = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=4 * H,
        max_position_embeddings=514,
    )
    return text(RobertaModel(c, add_pooling_layer=False), ("input_ids", "attention_mask"), ("last_hidden_state",))


def albert():
    from transformers import AlbertConfig, AlbertModel

    c = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=128,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=4 * H,
    )
    return text(AlbertModel(c), ("input_ids", "attention_mask", "token_type_ids"), ("last_hidden_state",))


def electra():
    from transformers import ElectraConfig, ElectraModel

    c = ElectraConfig(
        vocab_size=VOCAB,
        embedding_size=128,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=4 * H,
    )
    return text(ElectraModel(c), ("input_ids", "attention_mask"), ("last_hidden_state",))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return causal(MistralForCausalLM, dec_cfg(MistralConfig, sliding_window=None))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return causal(Qwen2ForCausalLM, dec_cfg(Qwen2Config))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return causal(Qwen3ForCausalLM, dec_cfg(Qwen3Config, head_dim=32))


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return causal(Phi3ForCausalLM, dec_cfg(Phi3Config))


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return causal(GemmaForCausalLM, dec_cfg(GemmaConfig, head_dim=32, hidden_activation="gelu_pytorch_tanh"))


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        intermediate_size=4 * H,
        rotary_pct=0.25,
        max_position_embeddings=512,
    )
    return causal(GPTNeoXForCausalLM, c)


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    c = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        ffn_dim=4 * H,
        max_position_embeddings=512,
        word_embed_proj_dim=H,
    )
    return causal(OPTForCausalLM, c)


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    c = BloomConfig(vocab_size=VOCAB, hidden_size=H, n_layer=LAYERS, n_head=4)
    return causal(BloomForCausalLM, c)


def gpt_bigcode():
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    c = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=4, n_positions=512, multi_query=True)
    return causal(GPTBigCodeForCausalLM, c)


def stablelm():
    from transformers import StableLmConfig, StableLmForCausalLM

    return causal(StableLmForCausalLM, dec_cfg(StableLmConfig, partial_rotary_factor=0.25))


def _seq2seq(config_cls, model_cls):
    c = config_cls(
        vocab_size=VOCAB,
        d_model=H,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=4 * H,
        decoder_ffn_dim=4 * H,
        max_position_embeddings=512,
        use_cache=False,
    )
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    return text(model_cls(c), names, ("last_hidden_state",), use_cache=False)


def bart():
    from transformers import BartConfig, BartModel

    return _seq2seq(BartConfig, BartModel)


def deit():
    from transformers import DeiTConfig, DeiTModel

    c = DeiTConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=4 * H)
    return image(DeiTModel(c, add_pooling_layer=False), outs=["last_hidden_state"], hf=True)


def swin():
    from transformers import SwinConfig, SwinModel

    c = SwinConfig(embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=7)
    return image(SwinModel(c), outs=["last_hidden_state"], hf=True)


def beit():
    from transformers import BeitConfig, BeitModel

    c = BeitConfig(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=4 * H,
        use_relative_position_bias=True,
    )
    return image(BeitModel(c, add_pooling_layer=False), outs=["last_hidden_state"], hf=True)


def dinov2():
    from transformers import Dinov2Config, Dinov2Model

    c = Dinov2Config(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, image_size=224, patch_size=14)
    return image(Dinov2Model(c), outs=["last_hidden_state"], hf=True)


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    c = Wav2Vec2Config(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=4 * H,
        conv_dim=(64, 64, 64),
        conv_stride=(5, 4, 4),
        conv_kernel=(10, 4, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return {
        "module": Tuple(Wav2Vec2Model(c).eval(), ["input_values"], ["last_hidden_state"]),
        "inputs": [("input_values", torch.float32, ["batch", 8000], "float", None)],
        "outputs": ["last_hidden_state"],
        "bindings": [{"batch": 1}, {"batch": 2}],
        "example": {"batch": 2},
        "dynamic": ["batch"],
    }


def clip_text():
    from transformers import CLIPTextConfig, CLIPTextModel

    c = CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=4 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
    )
    return text(CLIPTextModel(c), ("input_ids", "attention_mask"), ("last_hidden_state", "pooler_output"))


def clip_vision():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    c = CLIPVisionConfig(
        hidden_size=H,
        intermediate_size=4 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        image_size=224,
        patch_size=32,
        hidden_act="quick_gelu",
    )
    return image(CLIPVisionModel(c), outs=["last_hidden_state", "pooler_output"], hf=True)


def siglip_vision():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    c = SiglipVisionConfig(
        hidden_size=H,
        intermediate_size=4 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        image_size=224,
        patch_size=16,
    )
    return image(SiglipVisionModel(c), outs=["last_hidden_state"], hf=True)


def t5_full():
    from transformers import T5Config, T5Model

    c = T5Config(
        vocab_size=VOCAB,
        d_model=H,
        d_kv=32,
        d_ff=688,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    return text(
        T5Model(c), ("input_ids", "attention_mask", "decoder_input_ids"), ("last_hidden_state",), use_cache=False
    )


def mbart():
    from transformers import MBartConfig, MBartModel

    return _seq2seq(MBartConfig, MBartModel)


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    c = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        new_decoder_architecture=True,
        num_kv_heads=2,
        parallel_attn=True,
        bias=False,
    )
    return causal(FalconForCausalLM, c)


def mpt():
    from transformers import MptConfig, MptForCausalLM

    c = MptConfig(vocab_size=VOCAB, d_model=H, n_layers=LAYERS, n_heads=4, max_seq_len=512)
    return causal(MptForCausalLM, c)


def codegen():
    from transformers import CodeGenConfig, CodeGenForCausalLM

    c = CodeGenConfig(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=4, rotary_dim=32, n_positions=512)
    return causal(CodeGenForCausalLM, c)


def mobilebert():
    from transformers import MobileBertConfig, MobileBertModel

    c = MobileBertConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=H,
        embedding_size=64,
        intra_bottleneck_size=64,
        true_hidden_size=64,
    )
    return text(MobileBertModel(c, add_pooling_layer=False), ("input_ids", "attention_mask"), ("last_hidden_state",))


def segformer():
    from transformers import SegformerConfig, SegformerModel

    c = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[4, 2],
        hidden_sizes=[32, 64],
        num_attention_heads=[1, 2],
        mlp_ratios=[4, 4],
        patch_sizes=[7, 3],
        strides=[4, 2],
    )
    return image(SegformerModel(c), outs=["last_hidden_state"], hf=True)


def kv(cls_cfg, model_cls, n_layers=LAYERS):
    c = cls_cfg
    kvh = getattr(c, "num_key_value_heads", c.num_attention_heads)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ins = [
        ("input_ids", torch.int64, ["batch", "sequence"], "ids", VOCAB),
        ("attention_mask", torch.int64, ["batch", "total_sequence"], "mask", None),
        ("position_ids", torch.int64, ["batch", "sequence"], "positions", None),
    ]
    outs = ["logits"]
    for i in range(n_layers):
        for k in ("key", "value"):
            ins.append((f"past_key_values.{i}.{k}", torch.float32, ["batch", kvh, "past_sequence", hd], "float", None))
            outs.append(f"present.{i}.{k}")
    bind = [
        {"batch": 1, "sequence": 8, "past_sequence": 5, "total_sequence": 13},
        {"batch": 2, "sequence": 1, "past_sequence": 17, "total_sequence": 18, "pad": "head3"},
    ]
    return {
        "module": KVDecoder(model_cls(c).eval(), n_layers),
        "inputs": ins,
        "outputs": outs,
        "bindings": bind,
        "example": {"batch": 2, "sequence": 3, "past_sequence": 6, "total_sequence": 9},
        "dynamic": ["batch", "sequence", "past_sequence", "total_sequence"],
    }


def qwen2_kv():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return kv(dec_cfg(Qwen2Config), Qwen2ForCausalLM)


def phi3_kv():
    from transformers import Phi3Config, Phi3ForCausalLM

    return kv(dec_cfg(Phi3Config), Phi3ForCausalLM)


def gpt2_kv():
    from transformers import GPT2Config, GPT2LMHeadModel

    c = GPT2Config(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=4, n_positions=512)
    c.num_attention_heads, c.hidden_size = 4, H
    return kv(c, GPT2LMHeadModel)


MODELS = {
    "distilbert": distilbert,
    "roberta": roberta,
    "albert": albert,
    "electra": electra,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "phi3": phi3,
    "gemma": gemma,
    "gpt_neox": gpt_neox,
    "opt": opt,
    "bloom": bloom,
    "gpt_bigcode": gpt_bigcode,
    "stablelm": stablelm,
    "bart": bart,
    "deit": deit,
    "swin": swin,
    "beit": beit,
    "dinov2": dinov2,
    "wav2vec2": wav2vec2,
    "mobilenetv3": timm_model("mobilenetv3_small_100"),
    "regnety": timm_model("regnety_002"),
    "densenet121": timm_model("densenet121"),
    "vit_small_timm": timm_model("vit_small_patch16_224"),
    "convnextv2": timm_model("convnextv2_atto"),
    "levit": timm_model("levit_128s"),
    "mobilevit": timm_model("mobilevit_xxs", size=256),
    "efficientnetv2": timm_model("tf_efficientnetv2_b0"),
    "clip_text": clip_text,
    "clip_vision": clip_vision,
    "siglip_vision": siglip_vision,
    "t5_full": t5_full,
    "mbart": mbart,
    "falcon": falcon,
    "mpt": mpt,
    "codegen": codegen,
    "mobilebert": mobilebert,
    "segformer": segformer,
    "qwen2_kv": qwen2_kv,
    "phi3_kv": phi3_kv,
    "gpt2_kv": gpt2_kv,
    "resnet50": timm_model("resnet50"),
    "mixer": timm_model("mixer_s32_224"),
    "poolformer": timm_model("poolformerv2_s12"),
    "mobilenetv4": timm_model("mobilenetv4_conv_small"),
    "ghostnet": timm_model("ghostnet_100"),
}

if __name__ == "__main__":
    if "--out" not in sys.argv:
        sys.argv += ["--out", os.path.expanduser("~/.cache/graphopt-more-exports")]
    build.MODELS = MODELS
    build.main()
