"""EXAONE-MoE (`ExaoneMoeForCausalLM`, K-EXAONE): EXAONE 4's attention (per-head q/k norms; windows on the layers
`layer_types` marks "sliding_attention", rope on those only where the config has a window) in the pre-norm Llama
layer, each MLP dense or DeepSeek-V3's MoE (sigmoid routing with the correction bias in the best groups, shared
experts) as `mlp_layer_types` says. The checkpoints' multi-token-prediction weights (`mtp.*`) are skipped."""
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import mlp_by_layer_type
from nanoinfer.models.exaone4 import Exaone4ForCausalLM
from nanoinfer.models.llama import LlamaForCausalLM


class ExaoneMoeForCausalLM(LlamaForCausalLM):
    attention_options = staticmethod(Exaone4ForCausalLM.attention_options)
    make_mlp = staticmethod(mlp_by_layer_type)
    ignored_weight_prefixes = ("mtp.",)
    # The correction bias sits beside the router in its checkpoints, in DeepseekRouter here.
    weight_name_substitutions = {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}

    def __init__(self, config: PretrainedConfig):
        # DeepSeek-V3's MoE reads its expert counts under DeepSeek's names.
        config.n_routed_experts, config.n_shared_experts = config.num_experts, config.num_shared_experts
        super().__init__(config)
