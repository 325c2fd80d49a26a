"""Apertus: Llama with per-head q/k RMSNorms before rope (as Qwen3's), its norms named `attention_layernorm` and
`feedforward_layernorm`, and a non-gated MLP, down(act(up(x))), whose xIELU activation ("xielu") has learned
parameters of its own in every layer."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.arcee import DENSE_MLP_NAMES
from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class ApertusForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = {**DENSE_MLP_NAMES, ".mlp.act_fn.": ".mlp.act.",
                                 ".attention_layernorm.": ".input_layernorm.",
                                 ".feedforward_layernorm.": ".post_attention_layernorm."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, False)
