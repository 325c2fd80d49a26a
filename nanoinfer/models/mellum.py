"""Mellum (`MellumForCausalLM`, JetBrains' Mellum2): Qwen3-MoE's attention (per-head q/k norms) on sliding and full
layers by `layer_types`, each type with its own rope settings (Gemma 3's nesting), and Qwen3-MoE's softmax-routed
experts or a dense MLP as `mlp_layer_types` says; the checkpoints' multi-token-prediction layer (`mtp.`) unused."""
from dataclasses import replace

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.deepseek_v3 import mlp_layer_type
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.llama import AttentionOptions, LlamaMLP
from nanoinfer.models.qwen3 import Qwen3ForCausalLM
from nanoinfer.models.qwen3_moe import Qwen3MoeSparseMoeBlock


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    check_layer_types(config)
    for layer_type in sorted(set(config.layer_types)):
        # transformers' Mellum rotates whole heads with the tables of a partial rope, which fails on their shapes.
        if (factor := rope_parameters(config, layer_type).get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"rope_parameters[{layer_type!r}] partial_rotary_factor={factor} in "
                             f"{config.name_or_path or 'the model config'} is not supported: transformers' Mellum "
                             f"rotates whole heads only")


class MellumForCausalLM(Qwen3ForCausalLM):
    ignored_weight_prefixes = ("mtp.",)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return replace(Qwen3ForCausalLM.attention_options(config, layer_idx),
                       rope_layer_type=config.layer_types[layer_idx])

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Qwen3MoeSparseMoeBlock(config) if mlp_layer_type(config, layer_idx) == "sparse" else LlamaMLP(config)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
