"""Mllama's language model (Llama 3.2 Vision, text only): Llama layers (llama3 rope, GQA, no biases) with a
cross-attention layer at each index of `cross_attention_layers`, which transformers' MllamaTextModel skips outright
when there are no image states (nor cached ones): so here they are not built, and their checkpoint tensors are not
loaded. The token embeddings hold 8 rows past the vocabulary (the image token's and spares); the LM head does not."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.models.llama import LlamaForCausalLM, LlamaModel, MLPFactory, OptionsFactory
from nanoinfer.models.vision_language import LANGUAGE_MODEL_NAMES

EXTRA_EMBEDDING_ROWS = 8  # MllamaTextModel's embed_tokens: vocab_size + 8 rows


class SkippedCrossAttentionLayer(nn.Module):
    """A cross-attention layer's place: text without images passes through it unchanged."""

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x, residual


class MllamaTextModel(LlamaModel):
    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        return VocabParallelEmbedding(config.vocab_size + EXTRA_EMBEDDING_ROWS, config.hidden_size)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, attention_options: OptionsFactory,
                   make_mlp: MLPFactory) -> nn.Module:
        if layer_idx in config.cross_attention_layers:
            return SkippedCrossAttentionLayer()
        return super().make_layer(config, layer_idx, attention_options, make_mlp)


def cross_attention_prefixes(config: PretrainedConfig) -> tuple[str, ...]:
    """The checkpoint names of the cross-attention layers: MllamaForCausalLM's `model.layers.{i}.` and the same
    layers where a vision-language checkpoint keeps its language model (vision_language.LANGUAGE_MODEL_NAMES)."""
    roots = ["model."] + [old[1:] for old, new in LANGUAGE_MODEL_NAMES.items() if new == "model."]
    return tuple(f"{root}layers.{i}." for root in roots for i in config.cross_attention_layers)


class MllamaForCausalLM(LlamaForCausalLM):
    model_class = MllamaTextModel

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        if config.tie_word_embeddings:  # transformers never ties the head (vocab_size rows) to the embeddings (8 more)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.ignored_weight_prefixes = cross_attention_prefixes(config)
