"""DeepSeek-OCR 2's language model (`deepseek_ocr2_text`, run text only under DeepseekOcr2ForConditionalGeneration):
Llama's multi-head attention (no MLA; head_dim hidden_size / num_attention_heads, rotate-half rope) over DeepSeek-V2's
MoE (softmax routing, greedy or group-limited, scaled, plus shared experts), dense or sparse as `mlp_layer_types`
says."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v2 import DeepseekV2MoE
from nanoinfer.models.deepseek_v3 import mlp_by_layer_type
from nanoinfer.models.llama import LlamaForCausalLM


class DeepseekOcr2TextForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if config.mlp_layer_types is None:  # transformers' config has no default (nor first_k_dense_replace)
            raise ValueError(f"mlp_layer_types=None in {config_source(config)} is not supported; expected a list of "
                             f"'dense' or 'sparse', one per layer")
        return mlp_by_layer_type(config, layer_idx, DeepseekV2MoE)
