"""Gemma (1): the Llama decoder with (1 + weight) RMSNorms, a GeLU-tanh MLP, embeddings scaled by sqrt(hidden) and a
tied LM head. Gemma 2 (gemma2.py) builds on its model: sandwich norms, softcapping, sliding layers."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models.llama import (SCALED_INPUT_EMBEDDING, AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM,
                                    LlamaModel, MLPFactory, OptionsFactory)


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True in the model config: only causal Gemma is supported")


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, GemmaRMSNorm)


class GemmaModel(LlamaModel):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        # transformers multiplies by sqrt(hidden) rounded to the model's dtype (the one this is built under).
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class GemmaForCausalLM(LlamaForCausalLM):
    """The MLP's activation is `hidden_act`, which transformers' GemmaConfig turns from the Hub configs' legacy
    "gelu" into "gelu_pytorch_tanh" on load."""
    prompt_embeds_refused = SCALED_INPUT_EMBEDDING  # its subclasses' too

    model_class = GemmaModel
    check_config = staticmethod(check_config)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
