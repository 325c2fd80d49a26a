"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, `glm4_moe_lite`): DeepSeek-V3's model (MLA, interleaved rope by
`rope_interleave`, the sigmoid-routed MoE with its correction bias and shared experts, which GLM-4.5's is) whose MLPs
are dense or sparse as `mlp_layer_types` says."""
from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, mlp_by_layer_type


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    make_mlp = staticmethod(mlp_by_layer_type)
