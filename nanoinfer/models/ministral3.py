"""Ministral 3 (`Ministral3ForCausalLM`; the language model of Ministral-3's `Mistral3ForConditionalGeneration`):
Mistral's decoder (one window for every layer, where the config sets one) whose queries, after rope, are scaled by
position as Llama 4's attention temperature: 1 + llama_4_scaling_beta * log(1 + floor(position /
original_max_position_embeddings)), both read from the rope settings."""
from transformers import PretrainedConfig

from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.llama import AttentionOptions
from nanoinfer.models.mistral import MistralForCausalLM


def query_temperature(config: PretrainedConfig) -> tuple[float, float, float] | None:
    """Llama 4's temperature (AttentionOptions.query_temperature) without its position offset."""
    params = rope_parameters(config)
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    length = params.get("original_max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"original_max_position_embeddings={length!r} in the model config's rope_parameters must be "
                         f"a positive int beside llama_4_scaling_beta={beta}")
    return float(length), float(beta), 0.0


class Ministral3ForCausalLM(MistralForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=config.sliding_window, query_temperature=query_temperature(config))
