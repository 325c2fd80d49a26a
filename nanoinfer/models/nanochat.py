"""NanoChat: the Llama decoder with weightless RMSNorms (x / rms(x): no norm weights in the checkpoint), the same norm
on the embeddings before the first layer, rope turning by minus the angle (its rotate_half is (x2, -x1)) followed by
weightless q/k norms, Arcee's non-gated MLP (fc1 / fc2, relu^2 by `hidden_act`), and final-logit softcapping."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import WeightlessRMSNorm
from nanoinfer.models.gemma2 import Gemma2ForCausalLM
from nanoinfer.models.layernorm_decoder import DenseMLP
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class NanoChatDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, WeightlessRMSNorm)


class NanoChatModel(LlamaModel):
    decoder_layer = NanoChatDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.norm(self.embed_tokens(input_ids))  # weightless: transformers uses the final norm here too


class NanoChatForCausalLM(LlamaForCausalLM):
    model_class = NanoChatModel
    compute_logits = Gemma2ForCausalLM.compute_logits

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_after_rope=True,
                                qk_norm_class=WeightlessRMSNorm, rope_reversed=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, bias=False)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.final_logit_softcapping: float | None = config.final_logit_softcapping
