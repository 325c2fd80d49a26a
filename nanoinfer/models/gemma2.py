"""Gemma 2: the Llama attention with `query_pre_attn_scalar` scores, attention-logit softcapping and, on the layers
`layer_types` marks "sliding_attention", a sliding window; four (1 + weight) norms per layer, a GeLU-tanh MLP,
embeddings scaled by sqrt(hidden), final-logit softcapping. Gemma 3 (gemma3.py) is this with q/k norms and ropes
per layer type."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models.llama import (AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                    OptionsFactory, layer_sliding_window)

_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True in the model config: only causal Gemma is supported")
    for i, layer_type in enumerate(config.layer_types):
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}]={layer_type!r} in the model config; expected one of {_LAYER_TYPES}")


def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    bias = config.attention_bias
    return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=config.query_pre_attn_scalar ** -0.5,
                            sliding_window=layer_sliding_window(config, layer_idx),
                            logits_soft_cap=config.attn_logit_softcapping)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Norms around both the attention and the MLP: the residual adds the post-norm outputs."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options, LlamaMLP(config, hidden_act=config.hidden_activation), GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # transformers multiplies by sqrt(hidden) rounded to the model's dtype (the one this is built under).
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, attention_options(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    check_config = staticmethod(check_config)
    attention_options = staticmethod(attention_options)

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.check_config(config)
        self.model = Gemma2Model(config, self.attention_options)
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
