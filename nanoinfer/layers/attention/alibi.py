"""ALiBi (attention with linear biases, Press et al.): no position encoding; each head h adds -slope_h * |query position
- key position| to its scaled scores: slope_h * (key position - query position) under the causal mask, and, in a
non-causal pass, a penalty for distance on both sides, as flash-attn computes it. The slopes of BLOOM and MPT, which
differ for head counts that are not a power of two, and the bias as an additive mask for the PyTorch backend."""
import math

import torch


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    """transformers' `_get_alibi_slopes` (BLOOM; Falcon-RW): with p the largest power of two <= num_heads,
    2^(-8i/p) for i = 1..p, then for the remaining heads every other one of the 2p-head sequence, 2^(-4i/p) for
    odd i. fp32 [num_heads], as transformers computes them (torch.pow of a rounded fp32 base)."""
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(p) - 3))), dtype=torch.float32),
                       torch.arange(1, 1 + p, dtype=torch.int32))
    if p == num_heads:
        return slopes
    extra = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(2 * p) - 3))), dtype=torch.float32),
                      torch.arange(1, 1 + 2 * min(p, num_heads - p), 2, dtype=torch.int32))
    return torch.cat([slopes, extra])


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float) -> torch.Tensor:
    """MPT's `build_mpt_alibi_tensor` slopes: with P the smallest power of two >= num_heads, 2^(-i * max / P) for
    i = 1..P; for other head counts the odd-indexed ones first, then the even ones, cut to num_heads."""
    p = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, p + 1, dtype=torch.int64).float() * (alibi_bias_max / p))
    if p == num_heads:
        return slopes
    return torch.cat([slopes[1::2], slopes[::2]])[:num_heads]


def alibi_mask(slopes: torch.Tensor, distance: torch.Tensor, visible: torch.Tensor | None, dtype: torch.dtype
               ) -> torch.Tensor:
    """The additive mask -slope_h * |distance|, -inf where not visible: slopes [heads], distance (key position - query
    position) and visible broadcasting together to [..., n, keys] -> [..., heads, n, keys] (heads before distance's
    last two dims)."""
    bias = slopes.view(-1, 1, 1) * -distance.abs().unsqueeze(-3).to(slopes.dtype)
    if visible is not None:
        bias = bias.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    return bias.to(dtype)
