"""Falcon-H1 (`FalconH1ForCausalLM`): in every layer attention and a Mamba2 mixer side by side on the same normed
input, summed, then a SwiGLU MLP; the muP multipliers are folded into the weights they scale once loaded."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def mamba2_settings(config: PretrainedConfig) -> Mamba2Settings:
    """Falcon-H1's names: `mamba_d_ssm` channels (expand x hidden when None), the gated norm optional."""
    intermediate_size = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    heads, head_dim = config.mamba_n_heads, config.mamba_d_head
    if heads * head_dim != intermediate_size:
        raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must be mamba_d_ssm={intermediate_size}")
    return Mamba2Settings(config.hidden_size, heads, head_dim, config.mamba_n_groups, config.mamba_d_state,
                          config.mamba_d_conv, config.mamba_chunk_size, config.rms_norm_eps, config.mamba_conv_bias,
                          config.mamba_proj_bias, config.projectors_bias,
                          tuple(config.time_step_limit or (0.0, float("inf"))), config.hidden_act,
                          gated_norm=config.mamba_rms_norm, norm_before_gate=config.mamba_norm_before_gate)


class FalconH1DecoderLayer(HybridDecoderLayer):
    def __init__(self, config: PretrainedConfig):
        bias = config.attention_bias
        super().__init__(config, LlamaAttention(config, AttentionOptions(qkv_bias=bias, o_bias=bias)), True,
                         LlamaMLP(config), config.rms_norm_eps)
        self.mamba = Mamba2Mixer(mamba2_settings(config))

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
            ) -> torch.Tensor:
        return self.self_attn(positions, x, meta) + self.mamba(x, batch)

    @torch.no_grad()
    def fold_multipliers(self, config: PretrainedConfig) -> None:
        """transformers' activation multipliers as weight scales: attention's input (q, k, v), keys, output; the
        Mamba2 input and in_proj's segments (z, x, B, C, dt: `ssm_multipliers`; the mixer's sizes are this rank's
        rows of each), its output; the MLP's gate and down projection. A bias added after the scaled product is
        scaled with its weight."""
        attn, mamba, mlp = self.self_attn, self.mamba, self.mlp
        attn.qkv_proj.weight.mul_(config.attention_in_multiplier)
        _scale_rows(attn.qkv_proj, attn.q_size, attn.kv_size, config.key_multiplier)
        _scale_rows(attn.o_proj, 0, None, config.attention_out_multiplier)
        mamba.in_proj.weight.mul_(config.ssm_in_multiplier)
        inner, groups = mamba.intermediate_size, mamba.n_groups * mamba.state_size
        start = 0
        for size, multiplier in zip((inner, inner, groups, groups, mamba.num_heads), config.ssm_multipliers,
                                    strict=True):
            _scale_rows(mamba.in_proj, start, size, multiplier)
            start += size
        _scale_rows(mamba.out_proj, 0, None, config.ssm_out_multiplier)
        gate_multiplier, down_multiplier = config.mlp_multipliers
        _scale_rows(mlp.gate_up_proj, 0, mlp.gate_up_proj.weight.shape[0] // 2, gate_multiplier)
        _scale_rows(mlp.down_proj, 0, None, down_multiplier)


def _scale_rows(linear: nn.Module, start: int, size: int | None, multiplier: float) -> None:
    """Output rows [start, start + size) (None: to the end) of a linear layer's weight and bias times multiplier."""
    for param in (linear.weight, linear.bias):
        if param is not None:
            param.data[start:None if size is None else start + size].mul_(multiplier)


class FalconH1ForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".feed_forward.": ".mlp.",
        ".pre_ff_layernorm.": ".post_attention_layernorm.",
        "model.final_layernorm.": "model.norm.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return FalconH1DecoderLayer(config)

    def __init__(self, config: PretrainedConfig):
        # The embedding may be tied to the LM head: both multipliers stay in the forward pass.
        super().__init__(config, config.rms_norm_eps, config.embedding_multiplier, 1 / config.lm_head_multiplier)
        self.config = config

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        """Once, before the linear layers repack their weights (ModelRunner visits this module first)."""
        for layer in self.model.layers:
            layer.fold_multipliers(self.config)
