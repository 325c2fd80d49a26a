"""Molmo 2's language model (`molmo2_text`, run text only under Molmo2ForConditionalGeneration): Qwen3's attention
(`qk_norm_type` "qwen3") or OLMo 2's ("olmo"), norms before the sublayers or after them (`norm_after`), all rounding as
Llama's RMSNorm; q/k/v biases, the rope scaled on `rope_scaling_layers` only, extra embedding rows past the head's."""
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import copy_weight
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                    MLPFactory, OptionsFactory)
from nanoinfer.models.olmo2 import Olmo2Attention, Olmo2DecoderLayer, ProjectionNorm

QK_NORM_TYPES = ("qwen3", "olmo")
# The Hub's names (transformers' conversion mapping, which its save_pretrained writes back) to the engine's; the fused
# MLP input and the two embedding tables are converted first (Molmo2TextForCausalLM.convert_checkpoint).
HUB_NAMES = {"^model.transformer.blocks.": "model.layers.", "^model.transformer.ln_f.": "model.norm.",
             ".self_attn.att_proj.": ".self_attn.qkv_proj.", ".self_attn.attn_out.": ".self_attn.o_proj.",
             ".mlp.ff_out.": ".mlp.down_proj.", ".attn_norm.": ".input_layernorm.",
             ".ff_norm.": ".post_attention_layernorm."}
# With norm_after, transformers' input_layernorm norms the attention's output and its post_attention_layernorm the
# MLP's: OLMo 2's post_attention_layernorm and post_feedforward_layernorm (in this order, after HUB_NAMES).
NORM_AFTER_NAMES = {".post_attention_layernorm.": ".post_feedforward_layernorm.",
                    ".input_layernorm.": ".post_attention_layernorm."}
HUB_UP_GATE = ".mlp.ff_proj.weight"  # up_proj's rows, then gate_proj's
HUB_EMBEDDINGS = ("model.transformer.wte.embedding", "model.transformer.wte.new_embedding")  # joined in this order


class Molmo2QKNorm(ProjectionNorm, RMSNorm):
    """The "olmo" q/k norm: OLMo 2's over a whole projection, rounded as Llama's RMSNorm (cast back before the
    weight) as transformers' Molmo2RMSNorm does."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, self.rank_slice(loaded))

    def scale(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x [tokens, this rank's width] normalized by its full rows' mean squares [tokens, 1], times the weight."""
        return self.weight * (x.float() * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class Molmo2Attention(Olmo2Attention):
    qk_norm_class = Molmo2QKNorm


class Molmo2Layer:
    """Mixin of a decoder layer class: the attention of the config's qk_norm_type."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        # Set before nn.Module's __init__ (a plain attribute), read by the layer's.
        self.attention_class = Molmo2Attention if config.qk_norm_type == "olmo" else LlamaAttention
        super().__init__(config, options, mlp)


class Molmo2DecoderLayer(Molmo2Layer, LlamaDecoderLayer):
    """Norms before the sublayers."""


class Molmo2NormAfterDecoderLayer(Molmo2Layer, Olmo2DecoderLayer):
    """`norm_after`: norms after the sublayers (see NORM_AFTER_NAMES)."""

    norm_class = RMSNorm


class Molmo2TextModel(LlamaModel):
    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        layer = Molmo2NormAfterDecoderLayer if config.norm_after else Molmo2DecoderLayer
        return layer(config, attention_options(config, layer_idx), make_mlp(config, layer_idx))

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        return VocabParallelEmbedding(config.vocab_size + config.additional_vocab_size, config.hidden_size)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    if config.qk_norm_type not in QK_NORM_TYPES:
        raise ValueError(f"qk_norm_type={config.qk_norm_type!r} in {config_source(config)} is not supported; "
                         f"expected one of {QK_NORM_TYPES}")
    if not getattr(config, "use_qk_norm", True):  # a field of the Hub's configs that transformers ignores
        raise ValueError(f"use_qk_norm={config.use_qk_norm!r} in {config_source(config)} is not supported: "
                         f"transformers' Molmo 2 always norms q and k")


class Molmo2TextForCausalLM(LlamaForCausalLM):
    model_class = Molmo2TextModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, qk_norm=config.qk_norm_type == "qwen3",
                                rope_scaled=layer_idx in config.rope_scaling_layers)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        config.tie_word_embeddings = False  # transformers' Molmo 2 never ties: its head is narrower than the table
        super().__init__(config)
        self.weight_name_substitutions = HUB_NAMES | (NORM_AFTER_NAMES if config.norm_after else {})

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, the Hub's fused up/gate ones split and its two embedding tables (the
        vocabulary's and the additional rows) joined, last (the rest renamed by HUB_NAMES)."""
        tables = {}
        for name, tensor in weights:
            if name.endswith(HUB_UP_GATE):
                rows, stem = tensor.shape[0] // 2, name.removesuffix(HUB_UP_GATE)
                yield stem + ".mlp.up_proj.weight", tensor.narrow(0, 0, rows)
                yield stem + ".mlp.gate_proj.weight", tensor.narrow(0, rows, rows)
            elif name in HUB_EMBEDDINGS:
                tables[name] = tensor
            else:
                yield name, tensor
        if tables:
            yield "model.embed_tokens.weight", torch.cat([tables[name][...] for name in HUB_EMBEDDINGS
                                                          if name in tables])
