"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, `glm4_moe_lite`): DeepSeek-V3's model (MLA, interleaved rope by
`rope_interleave`, the sigmoid-routed MoE with its correction bias and shared experts, which GLM-4.5's is) whose MLPs
are dense or sparse as `mlp_layer_types` says."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from nanoinfer.models.llama import LlamaMLP

_MLP_TYPES = ("dense", "sparse")


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        mlp_type = config.mlp_layer_types[layer_idx]
        if mlp_type not in _MLP_TYPES:
            raise ValueError(f"mlp_layer_types[{layer_idx}]={mlp_type!r} in the model config; expected one of "
                             f"{_MLP_TYPES}")
        return cls.moe_class(config) if mlp_type == "sparse" else LlamaMLP(config)
