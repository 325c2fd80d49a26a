"""AFMoE (`AfmoeForCausalLM`, Arcee's Trinity): the Llama decoder with per-head q/k norms, an output gate of its own
projection (sigmoid, per element), rope on the sliding-window layers alone (the full ones NoPE), norms before and after
both sublayers (Gemma 2's layer), all applying their weight in fp32 (transformers keeps them in fp32), muP's
sqrt(hidden) embedding scale where `mup_enabled`; the first `num_dense_layers` MLPs dense, the others sigmoid-routed
experts chosen with an `expert_bias` (router logits and bias in the model's dtype), renormalized and scaled by
`route_scale`, plus ungated shared experts."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE
from nanoinfer.models.gemma2 import Gemma2DecoderLayer, check_layer_types
from nanoinfer.models.gpt_oss import GptOssRMSNorm
from nanoinfer.models.llama import (AttentionOptions, LlamaForCausalLM, LlamaMLP, LlamaModel, MLPFactory,
                                    OptionsFactory)


class AfmoeMoE(UngroupedSigmoidMoE):
    router_in_model_dtype = True  # transformers' `expert_bias` stays fp32 in fp16 models alone
    fp32_router_weight = False


class AfmoeDecoderLayer(Gemma2DecoderLayer):
    norm_class = GptOssRMSNorm


class AfmoeModel(LlamaModel):
    decoder_layer = AfmoeDecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.embed_scale = config.hidden_size ** 0.5 if config.mup_enabled else None

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale


class AfmoeForCausalLM(LlamaForCausalLM):
    model_class = AfmoeModel
    weight_name_substitutions = {
        ".self_attn.gate_proj.": ".self_attn.g_proj.",  # not an MLP's gate (packed_modules_mapping)
        ".pre_mlp_layernorm.": ".pre_feedforward_layernorm.",
        ".post_mlp_layernorm.": ".post_feedforward_layernorm.",
        ".mlp.router.gate.": ".mlp.gate.",
        ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=GptOssRMSNorm, rope=sliding,
                                sliding_window=config.sliding_window if sliding else None,
                                gate_activation=torch.sigmoid)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if layer_idx < config.num_dense_layers:
            return LlamaMLP(config)
        return AfmoeMoE(config, config.num_experts, config.moe_intermediate_size * config.num_shared_experts,
                        config.route_scale)

    def __init__(self, config: PretrainedConfig):
        check_layer_types(config)
        super().__init__(config)
