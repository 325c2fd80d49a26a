"""Qwen3-MoE: the Qwen3 decoder whose MLP is, on sparse layers, top-k routed experts (FusedMoE)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import LlamaMLP
from nanoinfer.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)  # the router
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # Which layers are sparse, exactly as transformers decides it.
        sparse = (layer_idx not in config.mlp_only_layers and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        return Qwen3MoeSparseMoeBlock(config) if sparse else LlamaMLP(config)
