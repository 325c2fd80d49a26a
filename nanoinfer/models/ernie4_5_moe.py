"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`, e.g. ERNIE-4.5-21B-A3B): the Llama decoder with optional biases on every
projection (`use_bias`), rope in the interleaved layout; MLPs from `moe_layer_start_index` to `moe_layer_end_index`
(every `moe_layer_interval`-th) are routed experts plus ungated shared experts, the others dense."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, Fp32Router
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


def select_experts_softmax_biased(router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor,
                                  norm_min: float | None, scaling: float = 1.0, sorted_topk: bool = True
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE's router: fp32 softmax over all experts; the choice is the top k of probability + correction_bias, the
    weights the chosen probabilities divided by their sum (at least norm_min). LongCat-Flash's: not renormalized
    (norm_min None), times `scaling`, the top k in torch.topk's unsorted order (as its router takes them)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    ids = torch.topk(probs + correction_bias, top_k, dim=-1, sorted=sorted_topk)[1]
    weights = probs.gather(1, ids)
    if norm_min is not None:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    return weights * scaling, ids


class Ernie4_5_MoeStatics(nn.Module):
    """Holds the checkpoint's `moe_statics.e_score_correction_bias` [1, experts] (one row: one expert group)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class Ernie4_5_MoeSparseMoeBlock(nn.Module):
    """A replicated router (`gate`), the routed experts (FusedMoE, each rank a slice of every expert) and
    `moe_num_shared_experts` shared experts as one MLP every token passes through, added ungated."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.top_k, self.norm_min = config.num_experts_per_tok, config.moe_norm_min
        # The router and the statics stay in fp32 in every model dtype, as transformers keeps them.
        self.gate = Fp32Router(config.hidden_size, config.num_experts, fp32_weight=True)
        self.moe_statics = Ernie4_5_MoeStatics(config.num_experts)
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                renormalize=False)  # routed by select_experts_softmax_biased, not by FusedMoE
        shared = config.moe_num_shared_experts or 0
        self.shared_experts = (LlamaMLP(config, config.moe_intermediate_size * shared, bias=config.use_bias)
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_softmax_biased(self.gate(x), self.top_k,
                                                     self.moe_statics.e_score_correction_bias[0], self.norm_min)
        y = self.experts.run_experts(x, weights.to(x.dtype), ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether a layer's MLP is routed experts, exactly as transformers decides it."""
    return ((layer_idx + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= layer_idx <= config.moe_layer_end_index)


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    # transformers' name for the statics (it renames the checkpoints' `mlp.moe_statics.` on load): either loads.
    weight_name_substitutions = {".mlp.gate.moe_statics.": ".mlp.moe_statics."}

    def __init__(self, config: PretrainedConfig):
        self.lm_head_bias = config.use_bias  # the LM head has a bias too; read by LlamaForCausalLM.__init__
        super().__init__(config)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias, rope_interleaved=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Ernie4_5_MoeSparseMoeBlock(config)
        return LlamaMLP(config, bias=config.use_bias)
