"""Mistral 4 (`Mistral4ForCausalLM`, `mistral4`; the language model of Mistral Small 4's
`Mistral3ForConditionalGeneration`): DeepSeek-V3's model (MLA with the rope layout by `rope_interleave`, the first
`first_k_dense_replace` MLPs dense, then routed experts plus shared ones) whose queries are scaled by position after
rope as Ministral 3's are, and whose router is DeepSeek-V3's group-limited one over softmax scores without a
correction bias, all in the model's dtype."""
import torch
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import select_experts_sigmoid_biased
from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from nanoinfer.models.llama import AttentionOptions
from nanoinfer.models.ministral3 import query_scale


def rotary_dim(config: PretrainedConfig) -> int:
    """The rope's width, qk_rope_head_dim: transformers' Mistral 4 rotates head_dim (qk_nope + qk_rope) times
    partial_rotary_factor dims (its default rope type all of head_dim), and fails on any other width."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        setting, dim = "rope_type='default'", config.head_dim
    else:
        factor = params.get("partial_rotary_factor", 1.0)
        setting, dim = f"partial_rotary_factor={factor}", int(config.head_dim * factor)
    if dim != config.qk_rope_head_dim:
        raise ValueError(f"rope_parameters' {setting} rotates {dim} of head_dim={config.head_dim} dims, not "
                         f"qk_rope_head_dim={config.qk_rope_head_dim}")
    return dim


class Mistral4MoE(DeepseekV3MoE):
    """DeepSeek-V3's block whose router (transformers' Mistral4TopkRouter) softmaxes its logits, picks the experts
    within the groups whose two best scores sum highest, renormalizes and scales, all in the model's dtype: its weight,
    logits, scores and routing weights are bf16 in a bf16 model."""
    correction_bias = False
    fp32_router_weight = False
    router_in_model_dtype = True

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def softmax(logits: torch.Tensor) -> torch.Tensor:  # the router's logits, upcast exactly, back to x's dtype
            return logits.to(x.dtype).softmax(-1)

        return select_experts_sigmoid_biased(self.gate(x), self.top_k, None, self.num_groups, self.topk_group,
                                             self.renormalize, self.scaling, scoring=softmax)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    moe_class = Mistral4MoE

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(rope_interleaved=bool(config.rope_interleave), rotary_dim=rotary_dim(config),
                                query_scale=query_scale(config))
