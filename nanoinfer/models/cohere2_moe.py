"""Cohere 2 MoE: Cohere 2's layer (cohere2.py: one norm feeding attention and MLP in parallel, rope on the sliding
layers only; an RMSNorm where the config sets `rms_norm_eps`) whose MLPs are, as `mlp_layer_types` says, dense
(`prefix_dense_intermediate_size` wide; their attention roped too where `prefix_dense_sliding_window_pattern` is 1)
or each token's top k of `num_experts` experts by router logit, weighted by a softmax over those k (or their sigmoids,
rescaled to sum to 1 where `norm_topk_prob`), plus `num_shared_experts` shared experts as one MLP, summed or averaged
with the routed output."""
import dataclasses

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, select_experts_sigmoid_topk, select_experts_topk_softmax
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.cohere2 import Cohere2ForCausalLM
from nanoinfer.models.deepseek_v3 import mlp_layer_type
from nanoinfer.models.llama import AttentionOptions, LlamaMLP

_SELECTIONS = ("softmax", "sigmoid")
_COMBINATIONS = ("sum", "average")


def check_setting(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} in the model config; expected one of {allowed}")


class Cohere2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        check_setting("expert_selection_fn", config.expert_selection_fn, _SELECTIONS)
        check_setting("shared_expert_combination_strategy", config.shared_expert_combination_strategy, _COMBINATIONS)
        self.sigmoid, self.renormalize = config.expert_selection_fn == "sigmoid", config.norm_topk_prob
        self.average = config.shared_expert_combination_strategy == "average"
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        # renormalize=False: FusedMoE.forward's softmax routing is not used, forward routes instead.
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size, config.intermediate_size,
                                renormalize=False)
        shared = config.num_shared_experts
        self.shared_experts = LlamaMLP(config, config.intermediate_size * shared) if shared else None

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sigmoid:
            return select_experts_topk_softmax(router_logits, self.top_k)
        weights, ids = select_experts_sigmoid_topk(router_logits, self.top_k)
        return (weights / weights.sum(-1, keepdim=True) if self.renormalize else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts.run_experts(x, *self.select_experts(self.gate(x)))
        if self.shared_experts is None:
            return y
        y = y + self.shared_experts(x)
        return y / 2 if self.average else y


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        options = Cohere2ForCausalLM.attention_options(config, layer_idx)
        dense_roped = (config.mlp_layer_types[layer_idx] == "dense"
                       and config.prefix_dense_sliding_window_pattern == 1)
        return dataclasses.replace(options, rope=options.rope or dense_roped)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "dense":
            return LlamaMLP(config, config.prefix_dense_intermediate_size)
        return Cohere2MoeSparseMoeBlock(config)
