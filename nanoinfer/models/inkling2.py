"""Inkling-2 (`Inkling2ForCausalLM`; `Inkling2ForConditionalGeneration` read as text): Inkling's relative logits
(inkling.py) on sliding and full layers, with a sink logit per query and head from the hidden state, a sigmoid output
gate, queries, keys and relative states L2-clipped (queries and relative states after a learned scale), values
RMS-normed without weight, scores over sqrt(head_dim). Short convs on keys, values and both sublayers' outputs, plus their input,
scaled down by sqrt(K + 1); the full layers' key and value convs take taps of each token's own (static taps plus ones
projected per KV head from the layer's input), scaled by sqrt(2K + 1). Block attention residuals: the layers' sums
close a block every n_layers_per_attn_res_block layers, and the input of every layer, of its MLP, of a full layer's
queries, keys and values (each normed apart) and of the final norm is a softmax over depth, per token, of the closed
blocks and the open one (a learned query each). All MLPs are experts: a renormalised sigmoid router (a correction bias
for the choice), softcapped SwiGLU; the logits softcapped.

As Inkling's, the attention runs on the PyTorch backend alone (registry.pytorch_only_attention)."""
import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.fused_moe import FusedMoE, select_experts_sigmoid_biased, softcapped_swiglu
from nanoinfer.layers.layernorm import OlmoRMSNorm, RMSNorm
from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear, copy_weight
from nanoinfer.layers.recurrent import RecurrentBatch, load_rank_rows
from nanoinfer.models.deepseek_v2 import DeepseekRouter
from nanoinfer.models.hrm_text import InvocationAttention
from nanoinfer.models.hybrid import HybridModel
from nanoinfer.models.inkling import (HUB_NAMES, InklingConv, InklingForCausalLM, NormedEmbedding, RelativeLogits,
                                      ResidualConv, attention_shape, check_attention_config, log_scale,
                                      relative_attention)
from nanoinfer.utils.dist import tp_rank, tp_size

# The Hub's layout (what transformers' save_pretrained writes): Inkling's names (less its static conv weights', see
# HUB_PATTERNS), and Inkling-2's own, renamed as transformers' conversion_mapping ("inkling2_text") reads them.
HUB_NAMES = {k: v for k, v in HUB_NAMES.items() if k != "sconv.weight"} | {
    ".attn.gate_attn.": ".self_attn.gate_proj.", ".attn.attn_sink_proj.": ".self_attn.sink_proj.",
    ".attn.q_l2_clip.": ".self_attn.q_l2_clip.", ".attn.rel_l2_clip.": ".self_attn.rel_l2_clip.",
    ".attn_sconv.": ".post_attention_convolution.", ".mlp_sconv.": ".post_mlp_convolution.",
    "_input_norm.": "_input_layernorm."}
# Hub names that a plain substitution cannot rename, to transformers' names: the depth-softmax queries, stored apart
# (attn_queries[i] is layer i + 1's: layer 0 has none), and the convs' tensors, whose names prefix one another.
HUB_PATTERNS = ((re.compile(r"attn_res\.attn_queries\.(\d+)$"),
                 lambda m: f"layers.{int(m[1]) + 1}.attention_input.query"),
                (re.compile(r"attn_res\.mlp_queries\.(\d+)$"), r"layers.\1.mlp_input.query"),
                (re.compile(r"attn_res\.output_query$"), "final_input.query"),
                (re.compile(r"sconv\.weight$"), "sconv.conv1d.weight"),
                (re.compile(r"sconv\.static_w$"), "sconv.static_weight"),
                (re.compile(r"sconv\.weight_proj$"), "sconv.weight_proj.weight"))


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each vector (last dim) scaled down to an L2 norm of `threshold` where longer, in fp32."""
    xf = x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    return (xf * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


class ScaledL2Clip(nn.Module):
    """l2_clip after a learned scale per head and channel (`scale` [heads, dim], this rank's heads)."""

    def __init__(self, num_heads: int, dim: int, threshold: float):
        super().__init__()
        self.threshold = threshold
        self.scale = nn.Parameter(torch.empty(num_heads, dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_rank_rows(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_clip(x.float() * self.scale.float(), self.threshold).to(x.dtype)


class DynamicConv(ResidualConv):
    """The full layers' key or value conv: each token's taps are `static_weight` [K, channels] (by backward distance,
    the token's own first) plus, per KV head, `weight_proj` of the conv's input (the key's or value's hidden state)."""

    def __init__(self, config: PretrainedConfig, num_kv_heads: int, head_dim: int):
        kernel_size = config.conv_kernel_size
        super().__init__(num_kv_heads * head_dim, kernel_size, math.sqrt(2 * kernel_size + 1))
        self.num_kv_heads, self.head_dim, self.kernel_size = num_kv_heads, head_dim, kernel_size
        self.static_weight = nn.Parameter(torch.empty(kernel_size, num_kv_heads * head_dim), requires_grad=False)
        self.weight_proj = ColumnParallelLinear(config.hidden_size, num_kv_heads * tp_size() * kernel_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """static_weight: this rank's channels (dim 1)."""
        size = param.shape[1]
        copy_weight(param, loaded[...].narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor, dynamic_input: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        n, heads, k = x.shape[0], self.num_kv_heads, self.kernel_size
        dynamic = self.weight_proj(dynamic_input).float().view(n, heads, 1, k)
        taps = self.static_weight.float().t().reshape(heads, self.head_dim, k) + dynamic
        return self.convolve(x, taps.reshape(n, -1, k).flip(-1), batch)  # oldest input first, as causal_conv takes


class Inkling2Attention(nn.Module):
    per_step_host_state = True  # relative_attention reads each step's spans on the host: ModelRunner.model_capturable

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        sliding, heads, kv_heads, self.head_dim = attention_shape(config, layer_idx)
        # Apart, not one QKVParallelLinear: a full layer's queries, keys and values each have an input of their own.
        self.q_proj = ColumnParallelLinear(config.hidden_size, heads * self.head_dim)
        self.k_proj, self.v_proj = (ColumnParallelLinear(config.hidden_size, kv_heads * self.head_dim)
                                    for _ in range(2))
        self.num_heads, self.num_kv_heads = heads // tp_size(), kv_heads // tp_size()
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.r_proj = ColumnParallelLinear(config.hidden_size, heads * config.d_rel)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, heads * self.head_dim)
        self.sink_proj = ColumnParallelLinear(config.hidden_size, heads)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size)
        kernel_size = config.conv_kernel_size
        self.k_sconv, self.v_sconv = ((InklingConv(self.kv_size, kernel_size, True, math.sqrt(kernel_size + 1))
                                       if sliding else DynamicConv(config, self.num_kv_heads, self.head_dim))
                                      for _ in range(2))
        self.q_l2_clip = ScaledL2Clip(self.num_heads, self.head_dim, config.qk_l2_clip_threshold)
        self.rel_l2_clip = ScaledL2Clip(self.num_heads, config.d_rel, config.rel_l2_clip_threshold)
        self.k_clip, self.eps = config.qk_l2_clip_threshold, config.rms_norm_eps
        window = config.sliding_window_size if sliding else None
        self.rel_logits_proj = RelativeLogits(config.d_rel, window or config.rel_extent)
        self.log_scaling = None if sliding else (config.log_scaling_n_floor, config.log_scaling_alpha)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads, window)

    def kv_cache(self) -> Attention:
        """The Attention whose cache this run writes and reads: a looped layer's pass's (InvocationAttention)."""
        return self.attn.current if isinstance(self.attn, InvocationAttention) else self.attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch,
                xk: torch.Tensor | None = None, xv: torch.Tensor | None = None) -> torch.Tensor:
        """xk, xv: the keys' and values' inputs (a full layer's; a looped sliding layer's after its first pass), else
        x's."""
        xk, xv = x if xk is None else xk, x if xv is None else xv
        q, k, v = self.q_proj(x), self.k_proj(xk), self.v_proj(xv)
        if isinstance(self.k_sconv, DynamicConv):  # its taps from the keys' and values' inputs
            k, v = self.k_sconv(k, xk, batch), self.v_sconv(v, xv, batch)
        else:
            k, v = self.k_sconv(k, batch), self.v_sconv(v, batch)
        q = self.q_l2_clip(q.view(-1, self.num_heads, self.head_dim))
        k = l2_clip(k.view(-1, self.num_kv_heads, self.head_dim), self.k_clip)
        v = unweighted_rms_norm(v.view(-1, self.num_kv_heads, self.head_dim).float(), self.eps).to(v.dtype)
        r = self.rel_l2_clip(self.r_proj(x).view(q.shape[0], self.num_heads, -1))
        if self.log_scaling is not None:  # in fp32, as transformers scales them
            tau = log_scale(positions, *self.log_scaling)
            q, r = (q.float() * tau).to(q.dtype), (r.float() * tau).to(r.dtype)
        attn = self.kv_cache()
        attn.store(k, v, meta)
        out = relative_attention(attn, positions, q, k, v, self.rel_logits_proj(r), meta, self.sink_proj(x))
        return self.o_proj((out.float() * torch.sigmoid(self.gate_proj(x).float())).to(out.dtype))


class BlockAttentionResidual(nn.Module):
    """A softmax over depth, per token: learned queries (`query` [*query_shape, hidden]: one, or a softmax for each)
    over the closed blocks and the open one, each RMS-normed without weight (keys and values both), in fp32."""

    def __init__(self, hidden_size: int, query_shape: tuple[int, ...] = ()):
        super().__init__()
        self.query = nn.Parameter(torch.empty(*query_shape, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stacked = unweighted_rms_norm(torch.stack([*blocks, partial], -2).float(), 1e-6)  # [tokens, depth, hidden]
        query = self.query.float().view(-1, stacked.shape[-1])
        scores = torch.einsum("qh,tdh->tqd", query, stacked) * stacked.shape[-1] ** -0.5
        return torch.einsum("tqd,tdh->tqh", scores.softmax(-1), stacked).unbind(1)


class Inkling2MoE(nn.Module):
    """Routed experts alone: the top k of sigmoid scores + a correction bias, their scores renormalised, times
    route_scale; softcapped SwiGLU experts."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.top_k, self.route_scale = config.num_experts_per_tok, config.route_scale
        self.gate = DeepseekRouter(config, correction_bias=True, fp32_weight=True)
        self.experts = FusedMoE(config.n_routed_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                renormalize=False,
                                activation=softcapped_swiglu(config.mlp_gate_softcap, config.mlp_up_softcap))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_sigmoid_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias, 1,
                                                     1, renormalize=True, scaling=self.route_scale)
        return self.experts.run_experts(x, weights, ids)


class Inkling2DecoderLayer(nn.Module):
    """x_attn = residual(blocks, h); a = conv(attention(norm(x_attn))); the open block h + a (or a alone, h closing
    a block); then + conv(mlp(norm(residual(blocks, .))))."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.full = config.layer_types[layer_idx] == "hybrid"
        self.is_block_boundary = layer_idx % config.n_layers_per_attn_res_block == 0
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.attention_input = BlockAttentionResidual(hidden, (3,) if self.full else ()) if layer_idx > 0 else None
        self.mlp_input = BlockAttentionResidual(hidden)
        self.self_attn = Inkling2Attention(config, layer_idx)
        self.mlp = Inkling2MoE(config)
        if self.full:  # the queries', keys' and values' inputs normed apart
            self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm = (OlmoRMSNorm(hidden, eps)
                                                                                      for _ in range(3))
        else:
            self.input_layernorm = OlmoRMSNorm(hidden, eps)
        self.post_attention_layernorm = OlmoRMSNorm(hidden, eps)
        divisor = math.sqrt(config.conv_kernel_size + 1)
        self.post_attention_convolution, self.post_mlp_convolution = (
            InklingConv(hidden, config.conv_kernel_size, False, divisor) for _ in range(2))

    def attention_inputs(self, h: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The queries', keys' and values' inputs before their norms (a sliding layer's one for all three)."""
        return (h,) * (3 if self.full else 1) if self.attention_input is None else self.attention_input(blocks, h)

    def attend(self, positions: torch.Tensor, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype,
               meta: AttentionMetadata, batch: RecurrentBatch) -> torch.Tensor:
        """The attention over inputs (see attention_inputs; a looped sliding layer's may be three), each normed."""
        norms = (self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm) if self.full else (
            (self.input_layernorm,) * 3)
        x, *kv = (norm(t).to(dtype) for norm, t in zip(norms, inputs))
        return self.self_attn(positions, x, meta, batch, *kv)

    def add_attention(self, h: torch.Tensor, blocks: list[torch.Tensor], a: torch.Tensor, batch: RecurrentBatch
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The attention's output a (convolved) added to the open block h, or opening the next one -> (the open
        block's sum in fp32, the closed blocks)."""
        x = self.post_attention_convolution(a, batch).float()
        return (x, [*blocks, h]) if self.is_block_boundary else (h.float() + x, blocks)

    def add_mlp(self, x: torch.Tensor, mlp_input: torch.Tensor, dtype: torch.dtype, batch: RecurrentBatch
                ) -> torch.Tensor:
        y = self.post_attention_layernorm(mlp_input).to(dtype)
        return (x + self.post_mlp_convolution(self.mlp(y), batch)).to(dtype)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, blocks: list[torch.Tensor], meta: AttentionMetadata,
                batch: RecurrentBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """h: the open block's sum so far, blocks: the closed ones -> the same after this layer."""
        a = self.attend(positions, self.attention_inputs(h, blocks), h.dtype, meta, batch)
        x, blocks = self.add_attention(h, blocks, a, batch)
        return self.add_mlp(x, self.mlp_input(blocks, x)[0], h.dtype, batch), blocks


class Inkling2Model(HybridModel):
    """HybridModel's layers carrying the closed blocks; the final norm's input a softmax over depth too."""

    def __init__(self, config: PretrainedConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.final_input = BlockAttentionResidual(config.hidden_size)

    @staticmethod
    def run(layers: Iterable[nn.Module], positions: torch.Tensor, h: torch.Tensor, blocks: list[torch.Tensor],
            meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for layer in layers:
            h, blocks = layer(positions, h, blocks, meta, batch)
        return h, blocks

    def run_layers(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers over the embeddings h -> the open block's sum and the closed blocks."""
        return self.run(self.layers, positions, h, [], meta, batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, blocks = self.run_layers(positions, self.embed_tokens(input_ids), meta, RecurrentBatch.from_metadata(meta))
        return self.norm(self.final_input(blocks, h)[0]).to(h.dtype)


def check_inkling2_config(config: PretrainedConfig) -> None:
    """Refuses by name what the layers cannot run as transformers does."""
    where = check_attention_config(config)
    # The Hub's checkpoints hold MXFP8 experts (e4m3, a ue8m0 scale per 32 values, as `w13_weight_scale`), which
    # transformers' Inkling2Config adds to a config.json without one: quantization.py's FP8 scheme pairs other names.
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"quantization_config (quant_method={method!r}) in {where}: Inkling-2's quantized (MXFP8) "
                         "experts are not supported; use a checkpoint saved unquantized (bf16/fp32)")
    blocks = config.n_layers_per_attn_res_block  # every layer index modulo it says whether the layer closes a block
    if not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"n_layers_per_attn_res_block={blocks!r} in {where}; expected a positive int")
    if config.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func={config.scoring_func!r} in {where} is not supported; only 'sigmoid' is "
                         "implemented")


class Inkling2ForCausalLM(InklingForCausalLM):
    packed_modules_mapping = {}
    weight_name_substitutions = HUB_NAMES
    model_class = Inkling2Model
    check_config = staticmethod(check_inkling2_config)

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Inkling2DecoderLayer(config, layer_idx)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        """OlmoRMSNorm, as all of Inkling-2's norms: transformers' Inkling2RMSNorm applies its weight in fp32 and
        rounds once (Inkling's rounds before the weight); they differ on the bf16 embedding and the first layer's bf16
        input (the other norms' inputs are fp32 depth softmaxes)."""
        return OlmoRMSNorm(config.hidden_size, eps)

    def make_embedding(self, config: PretrainedConfig) -> nn.Module:
        return NormedEmbedding(config.vocab_size, config.hidden_size, config.rms_norm_eps, OlmoRMSNorm)

    @staticmethod
    def convert_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Inkling's conversion (the experts' gate/up rows split), the Hub names of HUB_PATTERNS renamed."""
        for name, tensor in InklingForCausalLM.convert_checkpoint(weights):
            for pattern, new in HUB_PATTERNS:
                name = pattern.sub(new, name)
            yield name, tensor
