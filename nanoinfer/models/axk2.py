"""A.X-K2 (`AXK2ForCausalLM`): DeepSeek-V3.2 (deepseek_v32.py: MLA with DeepSeek sparse attention) whose query and a
per-element output gate come from one projection (the checkpoints' `q_b_proj`) of the query latent beside the latent
before its norm, the attention output times sigmoid(gate) before o_proj; each input norm, and the post-attention norm
of MoE layers, an RMSNorm times the sigmoid of a low-rank SiLU MLP of its output (`gated_norm_rank`); the MoE routed
by sigmoid scores plus the correction bias over all experts (A.X-K2-Light's: no expert groups)."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear
from nanoinfer.models.deepseek_v2 import DeepseekV2MoE
from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE, mlp_layer_type
from nanoinfer.models.deepseek_v32 import (DeepseekV32Attention, DeepseekV32DecoderLayer, DeepseekV32ForCausalLM,
                                           DeepseekV32Model, DSAOptions)
from nanoinfer.models.llama import LlamaMLP


class AXK2Attention(DeepseekV32Attention):
    def __init__(self, config: PretrainedConfig, options: DSAOptions):
        super().__init__(config, options)
        # The checkpoints' q_b_proj (transformers' q_gate_proj) yields each head's query, then its gate: column-parallel
        # over heads, each rank has both of its heads'.
        self.q_b_proj = ColumnParallelLinear(2 * config.q_lora_rank,
                                             config.num_attention_heads * (self.nope_dim + self.rope_dim + self.v_dim))

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_compressed = self.q_a_proj(x)
        q_latent = self.q_a_layernorm(q_compressed)
        q, gate = self.q_b_proj(torch.cat([q_latent, q_compressed], -1)).view(x.shape[0], self.num_heads, -1).split(
            [self.nope_dim + self.rope_dim, self.v_dim], -1)
        o = self.sparse_attention(positions, x, q, q_latent, meta)
        return self.o_proj((o * torch.sigmoid(gate.reshape(o.shape).float())).to(o.dtype))


class AXK2GatedRMSNorm(nn.Module):
    """y = RMSNorm(x), then y * sigmoid(W_up(silu(W_down(y)))) (the sigmoid in fp32; W_down to `gated_norm_rank`),
    called as RMSNorm is (with a residual: the sum normalized, and returned as the new residual stream)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.W_down = ReplicatedLinear(config.hidden_size, config.gated_norm_rank)
        self.W_up = ReplicatedLinear(config.gated_norm_rank, config.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            y, residual = self.norm(x, residual)
            return self.gate(y), residual
        return self.gate(self.norm(x))

    def gate(self, y: torch.Tensor) -> torch.Tensor:
        return (y * torch.sigmoid(self.W_up(F.silu(self.W_down(y))).float())).to(y.dtype)


class AXK2DecoderLayer(DeepseekV32DecoderLayer):
    attention_class = AXK2Attention

    def __init__(self, config: PretrainedConfig, options: DSAOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.input_layernorm = AXK2GatedRMSNorm(config)
        if isinstance(mlp, DeepseekV2MoE):
            self.post_attention_layernorm = AXK2GatedRMSNorm(config)


class AXK2Model(DeepseekV32Model):
    decoder_layer = AXK2DecoderLayer


class AXK2MoE(UngroupedSigmoidMoE):
    sorted_topk = False  # transformers' AXK2TopkRouter takes torch.topk's unsorted order


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    model_class = AXK2Model

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "dense":
            return LlamaMLP(config)
        return AXK2MoE(config, config.n_routed_experts, config.moe_intermediate_size * config.n_shared_experts,
                       config.routed_scaling_factor, renormalize=config.norm_topk_prob)

    def __init__(self, config: PretrainedConfig):
        if config.n_group is not None:  # transformers fills the other groups' scores with 0, not -inf as V3's router
            raise ValueError(f"n_group={config.n_group!r} in the model config: A.X-K2's grouped routing is not "
                             f"supported (A.X-K2-Light's, without groups, is)")
        super().__init__(config)
