"""HY-V4 (`HYV4ForCausalLM`, Tencent Hunyuan V4): GLM-MoE-DSA (glm_moe_dsa.py: MLA with DeepSeek sparse attention,
layers that reuse the last "full" indexer's selection; its rope on interleaved pairs, in the indexer too, as
transformers 5.25's: 5.23's rotated halves of the same checkpoints) with an indexer that ropes the last
qk_rope_head_dim dims of its heads (its key's LayerNorm at the config's rms_norm_eps), attention sinks, and a sigmoid
output gate per element (the Hub's `self_attn.linear_gate`); GLM-4.7-Flash's MoE whose routed experts clamp their
SwiGLU at `swiglu_limit`; and hyper-connections: each token carries hc_mult residual streams, each sublayer reads a
sigmoid-weighted sum of them and adds its output to every stream with a weight of its own (HyperConnection), and a
last weighted sum (HyperHead) goes to the final norm. The streams are per token, so the KV cache is GLM-MoE-DSA's.
HY-V4-VL's language model (`hy_v4_vl_text`, HYV4VLTextForCausalLM) is this with its latent norms at the config's
rms_norm_eps (HY-V4's at transformers' default 1e-6); its multimodal rope is the 1-D rope on text."""
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.fused_moe import clamped_silu_and_mul
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.config_checks import check_each_in, config_source
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE, mlp_layer_type
from nanoinfer.models.deepseek_v32 import (DeepseekV32Attention, DeepseekV32DecoderLayer, DSAOptions,
                                           check_dsa_config)
from nanoinfer.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from nanoinfer.models.llama import LlamaMLP, LlamaModel, MLPFactory, OptionsFactory, keep_in_fp32_


def stream_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [tokens, hc_mult, hidden] -> fn's logits of the token's streams flattened, over their RMS (fp32)."""
    flat = streams.flatten(1).float()
    return F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The streams' sum weighted by weights [tokens, hc_mult] (fp32) -> [tokens, hidden] in the streams' dtype."""
    return (weights.unsqueeze(-1) * streams).sum(1).to(streams.dtype)


def fp32_parameter(*shape: int) -> nn.Parameter:
    # transformers keeps the hyper-connections' parameters in fp32 in 16-bit models.
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    """transformers' HYV4HyperConnection: from the streams, a sublayer's input (their sum weighted by
    sigmoid(pre) + hc_eps) and the weights (hc_magnitude * sigmoid(post) + hc_eps) of its output in each stream."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.hc_mult, self.hc_eps, self.eps = config.hc_mult, config.hc_eps, config.rms_norm_eps
        self.magnitude = config.hc_magnitude
        self.fn = fp32_parameter(2 * self.hc_mult, self.hc_mult * config.hidden_size)
        self.base = fp32_parameter(2 * self.hc_mult)
        self.scale = fp32_parameter(2)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [tokens, hc_mult, hidden] -> the sublayer's input [tokens, hidden], post [tokens, hc_mult]."""
        pre, post = (stream_mixes(streams, self.fn, self.eps) * self.scale.repeat_interleave(self.hc_mult)
                     + self.base).split(self.hc_mult, -1)
        return collapse(streams, torch.sigmoid(pre) + self.hc_eps), self.magnitude * torch.sigmoid(post) + self.hc_eps

    @staticmethod
    def add_output(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sublayer's output [tokens, hidden] added to each stream times its post weight (in fp32)."""
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """transformers' HYV4HyperHead: the streams' sum weighted by sigmoid(mixes * hc_scale + hc_base) + hc_eps."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.hc_eps, self.eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = fp32_parameter(config.hc_mult, config.hc_mult * config.hidden_size)
        self.hc_base = fp32_parameter(config.hc_mult)
        self.hc_scale = fp32_parameter(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = stream_mixes(streams, self.hc_fn, self.eps)
        return collapse(streams, torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps)


# What transformers keeps in fp32 in 16-bit models besides the hyper-connections and the LM head
# (`_keep_in_fp32_modules_strict`): the sinks, which then join the scores' softmax in fp32, and the indexer's
# weights_proj and key norm, which run on the input upcast (the indexer casts to their dtype).
FP32_ATTENTION_MODULES = ("sinks", "indexer.weights_proj", "indexer.k_norm")


class HyperConnectedModel(LlamaModel):
    """A model whose tokens carry hc_mult residual streams (HY-V4's, DeepSeek-V4's): the embedding copied into each,
    every layer called as (positions, streams [tokens, hc_mult, hidden], token ids, meta) -> streams, and HyperHead's
    weighted sum to the final norm."""

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.hc_mult = config.hc_mult
        self.hc_head = HyperHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        streams = self.embed(input_ids, positions).unsqueeze(1).expand(-1, self.hc_mult, -1)
        for layer in self.layers:
            streams = layer(positions, streams, input_ids, meta)
        return self.norm(self.hc_head(streams))


class HYV4DecoderLayer(DeepseekV32DecoderLayer):
    """Called by HyperConnectedModel (the token ids unused here)."""

    def __init__(self, config: PretrainedConfig, options: DSAOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        keep_in_fp32_(self.self_attn, FP32_ATTENTION_MODULES)
        self.attn_hc, self.ffn_hc = HyperConnection(config), HyperConnection(config)

    def forward(self, positions: torch.Tensor | None, streams: torch.Tensor, input_ids: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x, post = self.attn_hc(streams)
        streams = self.attn_hc.add_output(streams, post, self.self_attn(positions, self.input_layernorm(x), meta))
        x, post = self.ffn_hc(streams)
        return self.ffn_hc.add_output(streams, post, self.mlp(self.post_attention_layernorm(x)))


class HYV4Model(HyperConnectedModel):
    decoder_layer = HYV4DecoderLayer


# Every layer's attention, as transformers 5.23 and 5.17 name it.
LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot run, refused by name rather than run differently from transformers."""
    where = config_source(config)
    check_each_in(config, "layer_types", LAYER_TYPES)
    if not config.swiglu_limit > 0:  # transformers' docstring: no clamp; its code: clamped at it (to zero, ...)
        raise ValueError(f"swiglu_limit={config.swiglu_limit!r} in {where} is not supported; expected > 0")
    if not isinstance(config.hc_mult, int) or config.hc_mult < 1:
        raise ValueError(f"hc_mult={config.hc_mult!r} in {where}; expected a positive int")
    check_dsa_config(config)


class HYV4ForCausalLM(GlmMoeDsaForCausalLM):
    model_class = HYV4Model
    lm_head_dtype = torch.float32  # kept in fp32 by transformers in 16-bit models, the hidden states upcast
    check_config = staticmethod(check_config)
    # The Hub's names (transformers' conversion mapping, which its save_pretrained writes back) to transformers' own,
    # then the output gate as MLA's g_proj, the sinks as the attention layer's parameter.
    weight_name_substitutions = {
        ".hc_pre.hc_attn_layer.hc_": ".attn_hc.", ".hc_pre.hc_mlp_layer.hc_": ".ffn_hc.",
        ".hc_pre.hc_head.hc_head_": ".hc_head.hc_", ".learnable_sink_param": ".sinks",
        ".self_attn.linear_gate.": ".self_attn.g_proj.", ".linear_gate.": ".gate_proj.",
        ".self_attn.gate_proj.": ".self_attn.g_proj.", ".self_attn.sinks": ".self_attn.attn.sinks"}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> DSAOptions:
        return replace(GlmMoeDsaForCausalLM.attention_options(config, layer_idx), indexer_rope_last=True,
                       indexer_norm_eps=config.rms_norm_eps, sinks=True, gate_activation=torch.sigmoid)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "dense":
            return LlamaMLP(config)
        return DeepseekV3MoE(config, activation=clamped_silu_and_mul(config.swiglu_limit))

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.ignored_weight_prefixes = ("model.mtp_layers.",)  # transformers skips the multi-token-prediction layers


class HYV4VLAttention(DeepseekV32Attention):
    def __init__(self, config: PretrainedConfig, options: DSAOptions):
        super().__init__(config, options)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)


class HYV4VLDecoderLayer(HYV4DecoderLayer):
    attention_class = HYV4VLAttention


class HYV4VLModel(HyperConnectedModel):
    decoder_layer = HYV4VLDecoderLayer


class HYV4VLTextForCausalLM(HYV4ForCausalLM):
    model_class = HYV4VLModel
    # The hyper-connection head as transformers 5.25 saves HY-V4-VL's (and reads it: not HY-V4's name, above).
    weight_name_substitutions = HYV4ForCausalLM.weight_name_substitutions | {".hc_head.hc_pre.hc_head_": ".hc_head.hc_"}
