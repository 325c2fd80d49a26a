"""Qwen3-MoE: the Qwen3 decoder whose MLP is, on sparse layers, top-k routed experts (FusedMoE)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.llama import LlamaMLP
from nanoinfer.models.qwen2_moe import is_sparse_layer
from nanoinfer.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Qwen3MoeSparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)


class Qwen3VLMoeLanguageModel(Qwen3MoeForCausalLM):
    """The language model of Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, see vision_language.py): its router
    always rescales the top k to sum to 1 (the text config has no norm_topk_prob)."""

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size, renormalize=True)


class Qwen3OmniMoeThinkerLanguageModel(Qwen3MoeForCausalLM):
    """The language model of the Qwen3-Omni thinker (`Qwen3OmniMoeThinkerForConditionalGeneration`, see
    vision_language.py), whose configs leave sliding_window unset: transformers' thinker attends to every position in
    prefill yet keeps only a window in its decode cache where one is set, which is refused rather than followed."""

    def __init__(self, config: PretrainedConfig):
        if config.sliding_window is not None:
            raise ValueError(f"sliding_window={config.sliding_window} in {config_source(config)} is not supported: "
                             f"transformers' Qwen3-Omni thinker attends without it in prefill, within it in decode")
        super().__init__(config)
