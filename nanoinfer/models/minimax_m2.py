"""MiniMax-M2: OLMoE's layer (olmoe.py: pre-norm, RMSNorms over the whole q and k projections before rope; no biases,
no clamping) with rope over the leading `rotary_dim` of each head, and on every layer each token's top k of
`num_local_experts` experts chosen on sigmoid score + `e_score_correction_bias` (DeepSeek-V3's rule with one group),
weighted by their unbiased scores rescaled to sum to 1. Checkpoints use Mixtral's names (`block_sparse_moe`, the
experts' w1/w3/w2)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, select_experts_sigmoid_biased
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions
from nanoinfer.models.mixtral import MixtralForCausalLM
from nanoinfer.models.olmoe import OlmoeForCausalLM


class MiniMaxM2MoE(nn.Module):
    """A replicated router (`gate`) and its correction bias in front of the experts (FusedMoE: each rank a slice of
    every expert)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        # renormalize=False: FusedMoE.forward's softmax routing is not used, forward routes instead.
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size, config.intermediate_size,
                                renormalize=False)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_sigmoid_biased(self.gate(x), self.top_k, self.e_score_correction_bias, num_groups=1,
                                             topk_group=1, renormalize=True, scaling=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x))


class MiniMaxM2ForCausalLM(OlmoeForCausalLM):
    weight_name_substitutions = MixtralForCausalLM.weight_name_substitutions

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        # The Hub's configs give the rotated width as `rotary_dim`, which transformers 5.17 does not read (5.23 turns
        # it into the rope's partial_rotary_factor): taken here either way.
        return AttentionOptions(rotary_dim=getattr(config, "rotary_dim", None))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return MiniMaxM2MoE(config)
