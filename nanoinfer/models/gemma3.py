"""Gemma 3 (text): the Llama attention with (1 + weight) q/k norms, `query_pre_attn_scalar` scores and, per layer
type, a sliding window and its own rope; four norms per layer, a GeLU-tanh MLP, embeddings scaled by sqrt(hidden)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models.llama import (AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                    layer_sliding_window)

_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if config.attn_logit_softcapping is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} in the model config: attention "
                         "logit softcapping is not supported by nanoinfer's attention backends")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True in the model config: only causal Gemma 3 is supported")
    for i, layer_type in enumerate(config.layer_types):
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}]={layer_type!r} in the model config; expected one of {_LAYER_TYPES}")


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    bias = config.attention_bias
    return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, gemma_norm=True,
                            scale=config.query_pre_attn_scalar ** -0.5,
                            sliding_window=layer_sliding_window(config, layer_idx),
                            rope_layer_type=config.layer_types[layer_idx])


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Norms around both the attention and the MLP: the residual adds the post-norm outputs."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__(config, attention_options(config, layer_idx),
                         LlamaMLP(config, hidden_act=config.hidden_activation), GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # transformers multiplies by sqrt(hidden) rounded to the model's dtype (the one this is built under).
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        check_config(config)
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping: float | None = config.final_logit_softcapping

    forward = LlamaForCausalLM.forward

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None or self.final_logit_softcapping is None:
            return logits
        return torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
