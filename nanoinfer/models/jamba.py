"""Jamba (`JambaForCausalLM`): attention layers (no position encoding) every `attn_layer_period` layers from
`attn_layer_offset`, Mamba-1 layers (dt, B, C RMS-normed) elsewhere; each followed by a SwiGLU MLP, or, every
`expert_layer_period` layers from `expert_layer_offset`, the top k of `num_experts` experts (weights not
renormalized)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.layers.mamba import MambaMixer, MambaSettings
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def jamba_mamba_settings(config: PretrainedConfig) -> MambaSettings:
    return MambaSettings(config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_state,
                         config.mamba_d_conv, config.mamba_dt_rank, config.mamba_conv_bias, config.mamba_proj_bias,
                         config.hidden_act, dt_bc_norm_eps=config.rms_norm_eps)


class JambaForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".mamba.": ".mixer.",
        ".feed_forward.router.": ".mlp.gate.",
        ".feed_forward.": ".mlp.",
        ".pre_ff_layernorm.": ".post_attention_layernorm.",
        "model.final_layernorm.": "model.norm.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # transformers' rules (JambaConfig.layers_block_type, layers_num_experts).
        is_attention = layer_idx % config.attn_layer_period == config.attn_layer_offset
        if is_attention:
            mixer = LlamaAttention(config, AttentionOptions(rope=False))
        else:
            mixer = MambaMixer(jamba_mamba_settings(config))
        if config.num_experts > 1 and layer_idx % config.expert_layer_period == config.expert_layer_offset:
            mlp = SparseMoeBlock(config, config.num_experts, config.intermediate_size, renormalize=False)
        else:
            mlp = LlamaMLP(config)
        return HybridDecoderLayer(config, mixer, is_attention, mlp, config.rms_norm_eps)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.rms_norm_eps)
