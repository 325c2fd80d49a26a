"""GLM-4-0414 (`Glm4ForCausalLM`): GLM-4 (glm.py) with an RMSNorm after the attention and after the MLP as well as
before each: Gemma 2's layer (gemma2.py) with plain RMSNorms, its norms under GLM-4's names."""
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.deepseek_v3 import mtp_layer_prefixes
from nanoinfer.models.gemma2 import Gemma2DecoderLayer
from nanoinfer.models.glm import GlmForCausalLM
from nanoinfer.models.llama import LlamaModel


class Glm4DecoderLayer(Gemma2DecoderLayer):
    norm_class = RMSNorm


class Glm4Model(LlamaModel):
    decoder_layer = Glm4DecoderLayer


class Glm4ForCausalLM(GlmForCausalLM):
    model_class = Glm4Model
    # Applied in this order: GLM-4's post_attention_layernorm (before the MLP) is renamed before its
    # post_self_attn_layernorm (after the attention) takes that name.
    weight_name_substitutions = {
        ".post_attention_layernorm.": ".pre_feedforward_layernorm.",
        ".post_self_attn_layernorm.": ".post_attention_layernorm.",
        ".post_mlp_layernorm.": ".post_feedforward_layernorm.",
    }

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # GLM-OCR's multi-token-prediction layer (numbered after the last decoder layer), which transformers skips too.
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)
