"""Ministral 3 (`Ministral3ForCausalLM`; the language model of Ministral-3's `Mistral3ForConditionalGeneration`):
Mistral's decoder (one window for every layer, where the config sets one) whose queries, after rope, are scaled by
position as Llama 4's attention temperature: 1 + llama_4_scaling_beta * log(1 + floor(position /
original_max_position_embeddings)), both read from the rope settings."""
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.llama import AttentionOptions, llama4_query_scale
from nanoinfer.models.mistral import MistralForCausalLM


def query_scale(config: PretrainedConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Llama 4's temperature (AttentionOptions.query_scale) without its position offset."""
    params = rope_parameters(config)
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    length = params.get("original_max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"original_max_position_embeddings={length!r} in the model config's rope_parameters must be "
                         f"a positive int beside llama_4_scaling_beta={beta}")
    return llama4_query_scale(float(length), float(beta), 0.0)


class Ministral3ForCausalLM(MistralForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=config.sliding_window, query_scale=query_scale(config))
