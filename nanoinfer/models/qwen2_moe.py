"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose MLP is, on sparse layers, top-k routed experts
plus a shared expert every token passes through, scaled by sigmoid(`shared_expert_gate`). Qwen3-MoE and Qwen3-Next
reuse its layer rule and block."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP, layer_sliding_window


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether a layer's MLP is routed experts, exactly as transformers decides it."""
    return (layer_idx not in config.mlp_only_layers and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig, renormalize: bool | None = None):
        """renormalize: whether the top k weights are rescaled to sum to 1; None: as config.norm_topk_prob says."""
        renormalize = config.norm_topk_prob if renormalize is None else renormalize
        super().__init__(config, config.num_experts, config.moe_intermediate_size, renormalize)
        # Column/row parallel like a dense MLP; its one-output gate is replicated.
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.qkv_bias, sliding_window=layer_sliding_window(config, layer_idx),
                                rope_in_dtype=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)
