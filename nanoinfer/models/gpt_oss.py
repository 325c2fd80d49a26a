"""GPT-OSS: the Llama decoder with q/k/v/o biases, yarn rope, attention sinks (a learned logit per head in every
softmax) on alternating sliding-window and full layers, fp32 RMSNorms, and on every layer a top-k router with a bias
in front of experts with biases and a clamped SwiGLU. bf16 checkpoints load as they are, OpenAI's MXFP4 ones
dequantized (nanoinfer/utils/quantization.py) into the same layout."""
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, clamped_swiglu, select_experts_topk_softmax
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.layers.linear import ReplicatedLinear, copy_weight
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# transformers 5.17 hard-codes these; later versions read them from the config (swiglu_alpha, swiglu_limit).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


class GptOssRMSNorm(GemmaRMSNorm):
    """x / rms(x) * w with w in fp32 whatever the model's dtype (transformers keeps GPT-OSS's norms in fp32), applied
    in fp32 before the cast back."""

    weight_loader = staticmethod(copy_weight)  # the weight as stored: no 1 + w


class GptOssExperts(FusedMoE):
    """FusedMoE from GPT-OSS's checkpoint layout, which transformers' GptOssExperts keeps: gate_up_proj
    [experts, hidden, 2 * inter] with the gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]), its
    bias [experts, 2 * inter] interleaved alike, down_proj [experts, inter, hidden]: de-interleaved and transposed
    into the stacked layout FusedMoE loads."""

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded[...]  # strided views below: read the whole tensor
        if param is self.w13_weight or param is self.w13_bias:
            loaded = torch.cat([loaded[..., ::2], loaded[..., 1::2]], -1)
        if param is self.w13_weight or param is self.w2_weight:  # stored [in, out]
            loaded = loaded.transpose(1, 2)
        super().load_stacked(param, loaded)


class GptOssMLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        activation = clamped_swiglu(getattr(config, "swiglu_alpha", SWIGLU_ALPHA),
                                    getattr(config, "swiglu_limit", SWIGLU_LIMIT))
        # renormalize=False: FusedMoE.forward's softmax routing is not used, select_experts_topk_softmax routes.
        self.experts = GptOssExperts(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.intermediate_size, renormalize=False, bias=True, activation=activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *select_experts_topk_softmax(self.router(x), self.experts.top_k))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, GptOssRMSNorm)


class GptOssModel(LlamaModel):
    decoder_layer = GptOssDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    # The sinks are the attention layer's parameter here (transformers': the attention module's).
    weight_name_substitutions = {".self_attn.sinks": ".self_attn.attn.sinks"}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """Llama's (biases from attention_bias, the window on the layers `layer_types` marks sliding), with sinks."""
        return replace(LlamaForCausalLM.attention_options(config, layer_idx), sinks=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GptOssMLP(config)
