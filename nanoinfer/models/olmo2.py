"""OLMo 2: the Llama attention with RMSNorms over the whole q and k projections (all heads at once, before rope), and
norms after each sublayer instead of before it: h = x + norm(attn(x)); out = h + norm(mlp(h))."""
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import OlmoRMSNorm, RMSNorm
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaModel, MLPFactory,
                                    OptionsFactory)
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size


class ProjectionNorm:
    """Mixin of an RMSNorm class: its norm of a whole q (or k) projection (OLMo 2's q/k norms, Molmo 2's "olmo" ones).
    Under tensor parallelism a rank holds its heads' columns of the projection, as QKVParallelLinear slices them (with
    fewer KV heads than ranks, one KV head on several ranks), and the same slice of the weight; the mean square is
    the full row's, summed across ranks (Olmo2Attention), which `scale` takes."""

    def __init__(self, total_heads: int, head_dim: int, eps: float):
        size = tp_size()
        super().__init__(max(1, total_heads // size) * head_dim, eps)
        self.full_size = total_heads * head_dim
        self.start = tp_rank() * total_heads // size * head_dim

    def rank_slice(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint's weight over the whole projection."""
        if loaded.shape[0] != self.full_size:
            raise ValueError(f"shape mismatch: checkpoint q/k norm has {loaded.shape[0]} weights, "
                             f"expected {self.full_size}")
        return loaded.narrow(0, self.start, self.weight.numel())


class Olmo2QKNorm(ProjectionNorm, OlmoRMSNorm):
    """OLMo 2's: the weight applied in fp32 before the rounding (OlmoRMSNorm's)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        super().weight_loader(param, self.rank_slice(loaded))

    def scale(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x [tokens, this rank's width] normalized by its full rows' mean squares [tokens, 1], times the weight."""
        return (x.float() * torch.rsqrt(mean_square + self.eps) * self.weight).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    qk_norm_class: type[ProjectionNorm] = Olmo2QKNorm  # Molmo 2's rounds as Llama's RMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        self.q_norm = self.qk_norm_class(config.num_attention_heads, self.head_dim, config.rms_norm_eps)
        self.k_norm = self.qk_norm_class(config.num_key_value_heads, self.head_dim, config.rms_norm_eps)
        self.tp_size, self.tp_group = tp_size(), tp_group()

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, q_size], k [tokens, kv_size] normalized over all heads' width (not per head, as Qwen3's): on one
        rank the RMSNorm layer (its fused kernels); on several, one all-reduce of both mean squares per layer."""
        if self.tp_size == 1:
            return self.q_norm(q), self.k_norm(k)
        # Every rank holds the same width of q (of k), and every KV head sits on as many ranks as any other: the
        # mean over ranks of their rows' mean squares is the full rows'.
        mean_square = torch.stack([q.float().pow(2).mean(-1), k.float().pow(2).mean(-1)], -1)
        dist.all_reduce(mean_square, group=self.tp_group)
        mean_square /= self.tp_size
        return self.q_norm.scale(q, mean_square[:, :1]), self.k_norm.scale(k, mean_square[:, 1:])

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = self.norm_qk(q, k)
        if self.clip_qkv is not None:  # OLMoE's, unlike OLMo 1's (LlamaAttention): after the q/k norms
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        # No position encoding in an encoder pass (positions None, see LLM.embed) or a NoPE layer (OLMo Hybrid's).
        if positions is not None and self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class Olmo2DecoderLayer(nn.Module):
    """EXAONE 4's layer too, with its own attention and norm classes."""

    attention_class: type[LlamaAttention] = Olmo2Attention
    norm_class: type[RMSNorm] = OlmoRMSNorm

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__()
        self.self_attn = self.attention_class(config, options)
        self.mlp = mlp
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: the stream is x + residual, the add left to the next layer (or the final norm)."""
        if residual is not None:
            x = x + residual
        h = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2Model(LlamaModel):
    decoder_layer = Olmo2DecoderLayer

    def __init__(self, config: PretrainedConfig, attention_options: OptionsFactory, make_mlp: MLPFactory):
        super().__init__(config, attention_options, make_mlp)
        self.norm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)  # the final norm rounds as the others


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias)
