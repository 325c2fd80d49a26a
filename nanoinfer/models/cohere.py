"""Cohere (Command-R, Command-R+): one bias-free LayerNorm feeding the attention and a gated SiLU MLP in parallel,
x + attn(ln(x)) + mlp(ln(x)); interleaved rope; optional per-head LayerNorms on queries and keys (`use_qk_norm`);
logits times `logit_scale`; tied embeddings."""
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel, maybe_per_head_qk_norm_attention
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class CohereDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        eps = config.layer_norm_eps
        # Cohere 2's config has no use_qk_norm: never a q/k norm.
        attention = maybe_per_head_qk_norm_attention(config, options, getattr(config, "use_qk_norm", False), eps)
        super().__init__(attention, mlp, config.hidden_size, eps, "parallel-one-norm",
                         norm=partial(LayerNorm, bias=False))


class CohereModel(LayerNormModel):
    decoder_layer = CohereDecoderLayer
    norm_bias = False


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
