"""Aria's language model (`AriaTextForCausalLM`, and the text side of `AriaForConditionalGeneration`): the Llama
decoder whose every MLP is each token's top `moe_topk` of `moe_num_experts` SiLU experts, weighted by a softmax over
their router logits, plus `moe_num_shared_experts` shared experts run as one MLP that many times wider."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, select_experts_topk_softmax
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import LlamaForCausalLM, LlamaMLP


class AriaTextMoELayer(nn.Module):
    """Each rank holds a slice of every expert's and the shared experts' intermediate dimension, and the whole
    router. The routed experts are SiLU-gated whatever `hidden_act` says (it is the shared experts')."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.moe_num_experts)
        # The checkpoints stack each expert's matrices as [in, out] (transformers' AriaExperts: is_transposed).
        self.experts = FusedMoE(config.moe_num_experts, config.moe_topk, config.hidden_size,
                                config.intermediate_size, renormalize=False, stacked_transposed=True)
        self.shared_experts = LlamaMLP(config, config.intermediate_size * config.moe_num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts.run_experts(x, *select_experts_topk_softmax(self.router(x), self.experts.top_k))
        return y + self.shared_experts(x)


class AriaTextForCausalLM(LlamaForCausalLM):
    # The Hub's (and transformers 5.17's) names of the stacked experts; 5.23 renames them on load, as here.
    weight_name_substitutions = {".mlp.experts.fc1.weight": ".mlp.experts.gate_up_proj",
                                 ".mlp.experts.fc2.weight": ".mlp.experts.down_proj"}

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return AriaTextMoELayer(config)
