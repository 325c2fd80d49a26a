"""Gemma (1): the Llama decoder with (1 + weight) RMSNorms, a GeLU-tanh MLP, embeddings scaled by sqrt(hidden) and a
tied LM head. Gemma 2 (gemma2.py) builds on its model: sandwich norms, softcapping, sliding layers."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.embed_head import ScaledEmbedding
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True in the model config: only causal Gemma is supported")


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, GemmaRMSNorm)


class GemmaModel(LlamaModel):
    decoder_layer = GemmaDecoderLayer

    @staticmethod
    def token_embedding(config: PretrainedConfig) -> nn.Module:
        """Times sqrt(hidden), rounded to the model's dtype (the one this is built under), as transformers scales."""
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(), device="cpu").item()
        return ScaledEmbedding(config.vocab_size, config.hidden_size, scale)

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """The MLP's activation is `hidden_act`, which transformers' GemmaConfig turns from the Hub configs' legacy
    "gelu" into "gelu_pytorch_tanh" on load."""

    model_class = GemmaModel
    check_config = staticmethod(check_config)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
