"""RMSNorm, optionally fused with the residual add that precedes it, or without a weight, or over a width split across
the tensor-parallel ranks; Gemma's (1 + weight) RMSNorm; nGPT's L2 norm; the gated RMSNorm of Gated DeltaNet and KDA;
LayerNorm (with the same residual add, or over a width split across the ranks) and StableLM's per-head LayerNorm."""
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cuda import triton_layers
from nanoinfer.layers.linear import copy_weight
from nanoinfer.utils.dist import tp_group, tp_rank, tp_size


class RMSNorm(nn.Module):
    fp32_weight = False  # an fp32 weight on 16-bit activations, applied in fp32 (GemmaRMSNorm)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        same_dtype = x.dtype == self.weight.dtype
        if same_dtype and cpu_kernels.use_cpu_kernels(x):  # one pass instead of ~8 ops
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        # One kernel instead of ~8; it rounds as _norm does for a weight of x's dtype or Gemma's fp32 one.
        if x.is_cuda and (same_dtype or self.fp32_weight) and (kernels := triton_layers()) is not None:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class RankSliced:
    """A norm (mixed in before its class) over a width split evenly across the tensor-parallel ranks, as a
    RowParallelLinear's input is: each rank holds its slice of every checkpoint vector (weight, bias); the
    statistics are the whole row's (the norm's forward all-reduces them)."""

    def __init__(self, full_size: int, eps: float):
        if full_size % tp_size():
            raise ValueError(f"tensor_parallel_size={tp_size()} does not divide the normalized width {full_size}")
        super().__init__(full_size // tp_size(), eps)
        self.full_size, self.tp_size, self.tp_group = full_size, tp_size(), tp_group()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"shape mismatch: checkpoint norm vector {tuple(loaded.shape)}, expected "
                             f"({self.full_size},)")
        width = param.numel()
        copy_weight(param, loaded.narrow(0, tp_rank() * width, width))


class ShardedRMSNorm(RankSliced, RMSNorm):
    """BitNet's norms of the attention output and of the MLP's activations: the mean square is the whole row's, the
    ranks' equal-width means averaged by one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        xf = x.float()
        mean_square = xf.pow(2).mean(-1, keepdim=True)
        dist.all_reduce(mean_square, group=self.tp_group)
        return self.weight * (xf * torch.rsqrt(mean_square / self.tp_size + self.eps)).to(x.dtype)


class WeightlessRMSNorm(RMSNorm):
    """Falcon-Mamba's norms of dt, B and C, Llama 4's of q and k: x / rms(x), no weight in the checkpoint (a buffer
    of ones here)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        del self.weight
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)


class Fp32ResidualRMSNorm(RMSNorm):
    """RMSNorm under Mamba's `residual_in_fp32` (transformers' MambaBlock, FalconMambaBlock): in a 16-bit model the
    residual stream stays in fp32, each layer's output added to it in fp32, and normalized after a rounding to the
    model's dtype; the final norm (`final`) normalizes the fp32 stream itself and applies the weight in fp32, rounding
    once after (as transformers' norm_f on that stream, then the LM head's cast). The stream's first term (the
    embeddings, residual None) needs no fp32. fp32 models: RMSNorm's fused kernels, the same numbers."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, final: bool = False):
        super().__init__(hidden_size, eps)
        self.final = final

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None or x.dtype == torch.float32:
            return super().forward(x, residual)
        residual = residual.float() + x
        normed = self._norm(residual) if self.final else self._norm(residual.to(x.dtype))
        return normed.to(x.dtype), residual


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) as transformers' Gemma3RMSNorm (and Qwen3NextRMSNorm, Qwen3_5RMSNorm: the checkpoint
    stores w = weight - 1) computes it: w in the model's dtype (the one this is built under), 1 + w in fp32, applied
    in fp32 before the cast back. In fp32 models: the plain RMSNorm's fused kernels; on CUDA in every dtype: the
    Triton kernel, which rounds this way for an fp32 weight."""

    fp32_weight = True

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.model_dtype = self.weight.dtype
        self.weight.data = self.weight.data.float()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded[...].to(self.model_dtype).float() + 1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


class OlmoRMSNorm(GemmaRMSNorm):
    """x / rms(x) * w as transformers' Olmo2RMSNorm / Olmo3RMSNorm (and Gemma4RMSNorm) compute it: w in the model's
    dtype, applied in fp32 before the cast back (Llama's RMSNorm casts first), i.e. GemmaRMSNorm's rounding on the
    weight as stored."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded[...].to(self.model_dtype).float())


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in fp32, cast back: an RMSNorm without a weight (Gemma 4's value norm and
    its router's input norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class L2Norm(nn.Module):
    """x / ||x|| over the last dimension, in fp32, cast back: nGPT's projection onto the unit sphere (Dory's norms, no
    weight). sharded: over a width split across the tensor-parallel ranks, as a RowParallelLinear's input is (the
    ranks' sums of squares added by one all-reduce)."""

    def __init__(self, eps: float = 1e-6, sharded: bool = False):
        super().__init__()
        self.eps = eps
        self.sharded, self.tp_group = sharded and tp_size() > 1, tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square_sum = xf.pow(2).sum(-1, keepdim=True)
        if self.sharded:
            dist.all_reduce(square_sum, group=self.tp_group)
        return (xf * torch.rsqrt(square_sum + self.eps)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * activation(gate), over the last dimension (one head): SiLU (Gated DeltaNet's) or sigmoid (Kimi
    Delta Attention's), taken in fp32. weight_in_fp32: the weight (of the model's dtype) applied in fp32 too, rounding
    once at the end, as transformers' KDA norm (KimiLinearRMSNormGated) does; otherwise RMSNorm's rounding before
    the weight (Qwen3NextRMSNormGated's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, weight_in_fp32: bool = False):
        super().__init__(hidden_size, eps)
        self.activation, self.weight_in_fp32 = activation, weight_in_fp32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if not self.weight_in_fp32:
            return super()._norm(x)
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self._norm(x) * self.activation(gate.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """nn.LayerNorm's arithmetic (F.layer_norm, weight and optional bias in the model's dtype), called as RMSNorm is:
    with a residual, the sum x + residual is normalized and returned as the new residual stream. affine=False: neither
    weight nor bias (OLMo's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False) if affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias and affine else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class ShardedLayerNorm(RankSliced, LayerNorm):
    """Kosmos-2.5's norm of the MLP's activations: the mean and variance are the whole row's, from the ranks' sums
    (one all-reduce each)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        xf = x.float()
        mean = xf.sum(-1, keepdim=True)
        dist.all_reduce(mean, group=self.tp_group)
        centered = xf - mean / self.full_size
        variance = centered.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(variance, group=self.tp_group)
        normed = (centered * torch.rsqrt(variance / self.full_size + self.eps)).to(x.dtype)
        return normed * self.weight + self.bias


class PerHeadLayerNorm(nn.Module):
    """StableLM's and Cohere's q/k norm: a bias-free LayerNorm over each head's features with a weight of its own per
    head, on x [tokens, heads, head_dim]. A rank holds the weights of its heads as QKVParallelLinear assigns them
    (with fewer KV heads than ranks, one head on several ranks); StableLM's checkpoint `norms.{h}.weight` arrive one
    per head (h the shard id, see StableLmForCausalLM.packed_modules_mapping), Cohere's all in one tensor."""

    def __init__(self, total_heads: int, head_dim: int, eps: float):
        super().__init__()
        size = tp_size()
        self.eps = eps
        self.total_heads = total_heads
        self.num_heads = max(1, total_heads // size)
        self.head_start = tp_rank() * total_heads // size
        self.weight = nn.Parameter(torch.ones(self.num_heads, head_dim), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, head: int | None = None) -> None:
        """loaded: head `head`'s weight [head_dim], or, head None, all heads' [total_heads, head_dim] (Cohere's)."""
        if head is None:
            if loaded.shape[0] != self.total_heads:
                raise ValueError(f"shape mismatch: checkpoint norm has {loaded.shape[0]} heads, "
                                 f"expected {self.total_heads}")
            copy_weight(param, loaded.narrow(0, self.head_start, self.num_heads))
        elif self.head_start <= head < self.head_start + self.num_heads:
            copy_weight(param.data[head - self.head_start], loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized and scaled in fp32, one rounding at the end, as nn.LayerNorm's kernel does.
        normed = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)
