"""EXAONE 4: OLMo 2's norms after each sublayer (Llama's RMSNorm) around Qwen3's attention (per-head q/k RMSNorms),
a sliding window on the layers `layer_types` marks "sliding_attention" and, where the config has a window, rope on
those layers only (the global ones have no position encoding)."""
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaModel, layer_sliding_window
from nanoinfer.models.olmo2 import Olmo2DecoderLayer


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_class = LlamaAttention
    norm_class = RMSNorm


class Exaone4Model(LlamaModel):
    decoder_layer = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    model_class = Exaone4Model

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        window = layer_sliding_window(config, layer_idx)
        return AttentionOptions(qk_norm=True, sliding_window=window,
                                rope=config.sliding_window is None or window is not None)
