"""Hunyuan MoE (`HunYuanMoEV1ForCausalLM`, e.g. Hunyuan-A13B): the Llama decoder whose per-head q/k RMSNorms
(`query_layernorm` / `key_layernorm`) come after the rotation, rope as configured ("dynamic" with a fixed `alpha`:
the NTK-alpha base); every MLP is each token's top k (renormalized) of routed experts plus an ungated shared MLP,
all of `intermediate_size`. `moe_topk` may be given per layer."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


class HunYuanMoEV1Moe(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        top_k = config.moe_topk if isinstance(config.moe_topk, int) else config.moe_topk[layer_idx]
        # transformers builds the router in fp32 (its logits and routing weights fp32) in every model dtype.
        super().__init__(config, config.num_experts, config.intermediate_size, renormalize=True, top_k=top_k,
                         fp32_router=True)
        self.shared_mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class HunYuanMoEV1ForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = {
        ".self_attn.query_layernorm.": ".self_attn.q_norm.",
        ".self_attn.key_layernorm.": ".self_attn.k_norm.",
        ".mlp.gate.wg.": ".mlp.gate.",  # the router
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_after_rope=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return HunYuanMoEV1Moe(config, layer_idx)
