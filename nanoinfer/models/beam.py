"""Beam (`BeamForCausalLM`): Qwen3-MoE's attention (per-head q/k RMSNorms before rope, biases where `attention_bias`)
gated per element by sigmoid(`gate_proj`(x) + `gate_bias` of the head), windows on the layers `layer_types` marks
"sliding_attention", rope by layer type (`rope_parameters` keyed by it; on a type whose settings are None no rope, the
queries scaled instead by (1 + (p + 1) / 2048) ** 0.1, a scalable softmax); OLMo's RMSNorms before and after each
sublayer, whose residual adds are depth-scaled (the model's n-th add, n from 2: out / sqrt(n) + residual *
sqrt((n - 1) / n)); MLPs dense or, as `mlp_layer_types` says, DeepSeek-V3's routed experts (grouped sigmoid routing
with a correction bias) without shared ones; final-logit softcapping."""
import math

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import OlmoRMSNorm
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE, mlp_layer_type
from nanoinfer.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, check_layer_types
from nanoinfer.models.llama import (AttentionOptions, LlamaForCausalLM, LlamaMLP, MLPFactory, OptionsFactory,
                                    layer_sliding_window)
from nanoinfer.models.olmo2 import Olmo2Model


def scalable_softmax_scale(positions: torch.Tensor) -> torch.Tensor:
    """The NoPE layers' query scale per token (AttentionOptions.query_scale), in fp32 as transformers computes it."""
    return torch.exp(0.1 * torch.log1p((positions.float() + 1) / 2048))


class BeamMoE(DeepseekV3MoE):
    sorted_topk = True

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.num_experts, shared_intermediate_size=0)


class BeamDecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's four norms (OLMo's rounding) around the sublayers. Each add is depth-scaled, so the layer adds the
    residual stream it is given itself and returns the last add's two scaled terms (x, residual): the next layer, or
    the final norm, sums them."""

    norm_class = OlmoRMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module, layer_idx: int):
        super().__init__(config, options, mlp)
        self.attn_add = 2 * (layer_idx + 1)  # the MLP's is the next

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        out = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h), meta))
        out, h = depth_scaled_terms(out, h, self.attn_add)
        h = out + h
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return depth_scaled_terms(out, h, self.attn_add + 1)


def depth_scaled_terms(out: torch.Tensor, residual: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-th residual add's terms, as transformers' depth_scaled_residual_add weighs them."""
    return out * (1.0 / math.sqrt(n)), residual * math.sqrt((n - 1) / n)


class BeamModel(Olmo2Model):  # OLMo's final norm
    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        return BeamDecoderLayer(config, attention_options(config, layer_idx), make_mlp(config, layer_idx), layer_idx)


class BeamForCausalLM(LlamaForCausalLM):
    model_class = BeamModel
    # The output gate's projection is not an MLP's gate_proj (which packed_modules_mapping fuses).
    weight_name_substitutions = {".self_attn.gate_proj.": ".self_attn.g_proj."}
    compute_logits = Gemma2ForCausalLM.compute_logits  # final-logit softcapping

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        layer_type, bias = config.layer_types[layer_idx], config.attention_bias
        rope = config.rope_parameters.get(layer_type) is not None
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=OlmoRMSNorm,
                                sliding_window=layer_sliding_window(config, layer_idx), rope=rope,
                                rope_layer_type=layer_type, query_scale=None if rope else scalable_softmax_scale,
                                gate_activation=torch.sigmoid, gate_bias=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return BeamMoE(config) if mlp_layer_type(config, layer_idx) == "sparse" else LlamaMLP(config)

    def __init__(self, config: PretrainedConfig):
        check_layer_types(config)
        config.n_routed_experts = config.num_experts  # DeepSeek's name, which its MoE's checks read
        super().__init__(config)
        self.final_logit_softcapping: float | None = config.final_logit_softcapping
