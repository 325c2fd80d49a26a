"""Gemma 2: Gemma (gemma.py) with the attention's `query_pre_attn_scalar` scores, attention-logit softcapping and,
on the layers `layer_types` marks "sliding_attention", a sliding window; four (1 + weight) norms per layer,
final-logit softcapping. Gemma 3 (gemma3.py) is this with q/k norms and ropes per layer type."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import GemmaRMSNorm, RMSNorm
from nanoinfer.models import gemma
from nanoinfer.models.config_checks import check_each_in
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaMLP, layer_sliding_window

_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    gemma.check_config(config)
    check_layer_types(config)


def check_layer_types(config: PretrainedConfig) -> None:
    check_each_in(config, "layer_types", _LAYER_TYPES)


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    bias = config.attention_bias
    return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=config.query_pre_attn_scalar ** -0.5,
                            sliding_window=layer_sliding_window(config, layer_idx),
                            logits_soft_cap=config.attn_logit_softcapping)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Norms around both the attention and the MLP: the residual adds the post-norm outputs (GLM-4's layer too,
    with its own kind of norm)."""

    norm_class: type[RMSNorm] = GemmaRMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, self.norm_class)
        self.pre_feedforward_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(gemma.GemmaModel):
    decoder_layer = Gemma2DecoderLayer


class Gemma2ForCausalLM(gemma.GemmaForCausalLM):
    model_class = Gemma2Model
    check_config = staticmethod(check_config)
    attention_options = staticmethod(attention_options)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, hidden_act=config.hidden_activation)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.final_logit_softcapping: float | None = config.final_logit_softcapping

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None or self.final_logit_softcapping is None:
            return logits
        return torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
