"""IBM Granite (3.x dense): the Llama decoder with four scalars — embeddings times `embedding_multiplier`, scores
scaled by `attention_multiplier`, each sublayer's output times `residual_multiplier`, logits over `logits_scaling`.
GraniteSWA adds attention sinks (GPT-OSS's), windows on the layers `layer_types` marks "sliding_attention" and a rope
base per layer (`layer_rope_theta`; 0: no position encoding). HyperCLOVAX (hyperclovax.py) and MiniCPM3
(minicpm3.py) build on its layer and model."""
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.gpt_oss import GptOssForCausalLM
from nanoinfer.models.llama import (AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, MLPFactory,
                                    OptionsFactory, layer_sliding_window)

# The sinks' checkpoint name, as GPT-OSS's.
SINKS_SUBSTITUTION = GptOssForCausalLM.weight_name_substitutions


class GraniteDecoderLayer(LlamaDecoderLayer):
    """With `use_post_norm` (HyperCLOVAX's Peri-LN), an RMSNorm on each sublayer's output before it is scaled."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: torch.nn.Module):
        super().__init__(config, options, mlp)
        self.residual_multiplier = self.mup_residual_multiplier(config)
        post_norm = getattr(config, "use_post_norm", False)
        self.post_norm1, self.post_norm2 = (RMSNorm(config.hidden_size, config.rms_norm_eps) if post_norm
                                            else nn.Identity() for _ in range(2))

    @staticmethod
    def mup_residual_multiplier(config: PretrainedConfig) -> float:
        return config.residual_multiplier

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The next norm adds its input to the residual stream: scaled first, as transformers' `residual + h * m`.
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.post_attention_layernorm(self.post_norm1(x) * self.residual_multiplier, residual)
        return self.post_norm2(self.mlp(x)) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    decoder_layer = GraniteDecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.embedding_multiplier = self.mup_embedding_multiplier(config)

    @staticmethod
    def mup_embedding_multiplier(config: PretrainedConfig) -> float:
        return config.embedding_multiplier

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=config.attention_multiplier)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.logits_scaling: float = config.logits_scaling

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits / self.logits_scaling


def swa_attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
    """Granite's, with sinks, the layer's window and its rope base (GraniteSWA, GraniteMoeSWA)."""
    theta = config.layer_rope_theta[layer_idx]
    return replace(GraniteForCausalLM.attention_options(config, layer_idx), sinks=True,
                   sliding_window=layer_sliding_window(config, layer_idx), rope=bool(theta), rope_theta=theta or None)


class GraniteSWAForCausalLM(GraniteForCausalLM):
    weight_name_substitutions = SINKS_SUBSTITUTION
    attention_options = staticmethod(swa_attention_options)
