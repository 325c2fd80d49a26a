"""ERNIE 4.5 (the dense models): Llama with interleaved rope and biases on q/k/v/o and the MLP where `use_bias`."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias, rope_interleaved=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, bias=config.use_bias)


class PaddleOCRTextForCausalLM(Ernie4_5ForCausalLM):
    """PaddleOCR-VL's language model (`PaddleOCRVLForConditionalGeneration`, see vision_language.py): ERNIE 4.5 with
    rope in the half-split layout (transformers' rotate_half on its checkpoints' q/k rows; its 3-D sections on text's
    equal positions are the 1-D rope)."""

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias)
