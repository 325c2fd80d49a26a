"""Cohere (Command-R, Command-R+): one bias-free LayerNorm feeding the attention and a gated SiLU MLP in parallel,
x + attn(ln(x)) + mlp(ln(x)); interleaved rope; optional per-head LayerNorms on queries and keys (`use_qk_norm`);
logits times `logit_scale`; tied embeddings."""
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm, RMSNorm
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel, maybe_per_head_qk_norm_attention
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


def norm_class_and_eps(config: PretrainedConfig) -> tuple[Callable[[int, float], nn.Module], float]:
    """The bias-free LayerNorm, or (Cohere 2 MoE's configs that set `rms_norm_eps`) an RMSNorm, and its epsilon."""
    if getattr(config, "rms_norm_eps", None) is not None:
        return RMSNorm, config.rms_norm_eps
    return partial(LayerNorm, bias=False), config.layer_norm_eps


class CohereDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        norm, eps = norm_class_and_eps(config)
        # Cohere 2's config has no use_qk_norm: never a q/k norm.
        attention = maybe_per_head_qk_norm_attention(config, options, getattr(config, "use_qk_norm", False),
                                                     config.layer_norm_eps)
        super().__init__(attention, mlp, config.hidden_size, eps, "parallel-one-norm", norm=norm)


class CohereModel(LayerNormModel):
    decoder_layer = CohereDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        norm, eps = norm_class_and_eps(config)
        return norm(config.hidden_size, eps)


class CohereForCausalLM(LlamaForCausalLM):
    model_class = CohereModel
    weight_name_substitutions = {".self_attn.q_norm.": ".self_attn.q_layernorm.",
                                 ".self_attn.k_norm.": ".self_attn.k_layernorm."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope_interleaved=True)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.logit_scale: float = config.logit_scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits * self.logit_scale
