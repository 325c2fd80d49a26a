"""Cohere 2 (Command R7B, Command A): Cohere (cohere.py) without q/k norms, with a sliding window on the layers
`layer_types` marks "sliding_attention" and rope on those only (the global layers have no position encoding)."""
from transformers import PretrainedConfig

from nanoinfer.models.cohere import CohereForCausalLM
from nanoinfer.models.llama import AttentionOptions, layer_sliding_window


class Cohere2ForCausalLM(CohereForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias, window = config.attention_bias, layer_sliding_window(config, layer_idx)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope_interleaved=True, sliding_window=window,
                                rope=window is not None)
