"""MiniCPM5-MoE (`MiniCPM5MoeForCausalLM`, OpenBMB's): Llama's attention (biases on q/k/v/o where `attention_bias`, no
q/k norms, rope over the whole head) whose `q_gate_proj` yields each head's query and then its output gate, as
Qwen3-Next's q_proj does (the output times sigmoid(gate) before o_proj); each MLP dense or DeepSeek-V3's MoE (sigmoid
routing with the correction bias within the best groups, scaled; ungated shared experts) as `mlp_layer_types` says."""
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import mlp_by_layer_type
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class MiniCPM5MoeForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = {".self_attn.q_gate_proj.": ".self_attn.q_proj."}
    make_mlp = staticmethod(mlp_by_layer_type)

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, output_gate=True)
