"""Flint (`FlintForCausalLM`, RecursiveSI's): GPT-OSS's decoder (its fp32-weight RMSNorms, attention sinks) with
Qwen3-MoE's per-head q/k norms, rope on the sliding-window layers alone (the full ones NoPE), q/k/v/o biases where
`attention_bias`; Qwen3-MoE's dense and sparse layers (`mlp_only_layers`, `decoder_sparse_step`), the sparse ones
top k experts by sigmoid scores of an fp32 router (no correction bias), renormalized where `norm_topk_prob`, plus
an ungated shared expert."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.gpt_oss import GptOssForCausalLM, GptOssRMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaMLP, keep_in_fp32_
from nanoinfer.models.qwen2_moe import is_sparse_layer


class FlintMoE(UngroupedSigmoidMoE):
    correction_bias = False


class FlintForCausalLM(GptOssForCausalLM):
    # The Hub's names (which transformers' save_pretrained writes back), then GPT-OSS's place for the sinks.
    weight_name_substitutions = {".self_attn.softmax_offset": ".self_attn.sinks", ".mlp.shared_expert.":
                                 ".mlp.shared_experts.", **GptOssForCausalLM.weight_name_substitutions}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=GptOssRMSNorm, rope=sliding,
                                sliding_window=config.sliding_window if sliding else None, sinks=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        return FlintMoE(config, config.num_experts, config.shared_expert_intermediate_size,
                        renormalize=config.norm_topk_prob)

    def __init__(self, config: PretrainedConfig):
        check_layer_types(config)
        super().__init__(config)
        # transformers' `_keep_in_fp32_modules_strict` (with the router's weight, FlintMoE's): the sinks then join the
        # scores' softmax in fp32 in 16-bit models.
        keep_in_fp32_(self, ("sinks",))
