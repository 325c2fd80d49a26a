"""Triton kernels for the elementwise layers of every decoder block on CUDA: fused residual add + RMSNorm,
SiLU-and-mul, and rotary embedding (with Qwen3's per-head q/k norm fused in). Programs work on one token row (the
rotary kernel: one block of its heads); rounding follows the PyTorch layers step by step."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP32_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 in a long prefill step (e.g. 64k rows x 32k)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)  # the residual stream keeps the activation dtype, as `x + residual` does
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / N
    y = x * tl.rsqrt(variance + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if not FP32_WEIGHT:  # the normalized activation is rounded to its dtype before the weight (transformers' Llama)
        y = y.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (y * w).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight, or with a residual: (RMSNorm(x + residual) * weight, x + residual). A weight of x's
    dtype multiplies the normalized x rounded to that dtype; an fp32 weight on 16-bit x (Gemma's 1 + w) multiplies
    it in fp32, rounded once after."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    assert x.stride(-1) == 1 and weight.dtype in (x.dtype, torch.float32)
    rows, n = x.shape
    out = torch.empty_like(x)
    res_in = x if residual is None else residual.reshape(-1, n)
    res_out = out if residual is None else torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), eps, N=n,
                                  BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                                  FP32_WEIGHT=weight.dtype != x.dtype)
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # as in _rms_norm_kernel: 64k rows x 2 x 18,944 (Qwen2.5-7B) pass 2^31
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :N]) * x[..., N:] for x [..., 2N]."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    assert x.stride(-1) == 1 and shape[-1] % 2 == 0
    rows, n = x.shape[0], shape[-1] // 2
    out = x.new_empty(rows, n)
    block = min(triton.next_power_of_2(n), 1024)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), N=n, BLOCK=block)
    return out.view(*shape[:-1], n)


@triton.jit
def _rms_norm_part(x, weight_ptr, offs, mask, r, dtype: tl.constexpr):
    """One slice of a head normalized by r = rsqrt(mean square + eps), rounded as _rms_norm_kernel rounds."""
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return ((x * r).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _rounded(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """fp32 x rounded to dtype (and back to fp32) with ROUND, else x as it is."""
    if ROUND:
        return x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, weight_ptr, out_ptr, stride_t, stride_h, num_heads, eps,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, HAS_NORM: tl.constexpr,
                   IN_DTYPE: tl.constexpr):
    """Grid (tokens, head blocks): each head's dims [0, HALF) and [HALF, 2 HALF) rotated in fp32 by the cos/sin row
    of the token's position (neox layout), the TAIL dims after them passed through; with HAS_NORM the head is
    RMS-normalized first; with IN_DTYPE the cos, sin, products and sums each rounded to x's dtype."""
    token = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    offs_t = tl.arange(0, BLOCK_TAIL)[None, :]
    half_ok = offs < HALF
    ok = (heads < num_heads) & half_ok
    t_ok = (heads < num_heads) & (offs_t < TAIL)
    src = x_ptr + token * stride_t + heads * stride_h
    a = tl.load(src + offs, mask=ok, other=0.0)
    dtype = a.dtype
    a = a.to(tl.float32)
    b = tl.load(src + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    t = tl.load(src + 2 * HALF + offs_t, mask=t_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1) + tl.sum(t * t, 1)) / HEAD_DIM + eps)[:, None]
        a = _rms_norm_part(a, weight_ptr, offs, half_ok, r, dtype)
        b = _rms_norm_part(b, weight_ptr + HALF, offs, half_ok, r, dtype)
        t = _rms_norm_part(t, weight_ptr + 2 * HALF, offs_t, offs_t < TAIL, r, dtype)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=half_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=half_ok, other=0.0)
    dst = out_ptr + (token * num_heads + heads) * HEAD_DIM
    cos, sin = _rounded(cos, dtype, IN_DTYPE), _rounded(sin, dtype, IN_DTYPE)
    tl.store(dst + offs, (_rounded(a * cos, dtype, IN_DTYPE) - _rounded(b * sin, dtype, IN_DTYPE)).to(dtype), mask=ok)
    tl.store(dst + HALF + offs, (_rounded(b * cos, dtype, IN_DTYPE) + _rounded(a * sin, dtype, IN_DTYPE)).to(dtype),
             mask=ok)
    tl.store(dst + 2 * HALF + offs_t, t.to(dtype), mask=t_ok)


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, in_dtype: bool = False) -> torch.Tensor:
    """x [tokens, heads, dim] (token and head rows may be strided) rotated by the fp32 cos/sin rows
    [max_position, half] of `positions`; dims from 2 * half on pass through. With norm_weight, each head is
    RMS-normalized first. in_dtype: rounded as RotaryEmbedding's in_dtype says. Returns a new contiguous tensor.
    One launch where the PyTorch code takes ~20."""
    tokens, heads, dim = x.shape
    half = cos.shape[-1]
    assert x.stride(-1) == 1 and 2 * half <= dim and positions.numel() == tokens
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert norm_weight is None or norm_weight.dtype == x.dtype and norm_weight.numel() == dim
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 16)
        tail = dim - 2 * half
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, positions, cos, sin, x if norm_weight is None else norm_weight, out, x.stride(0), x.stride(1), heads,
            eps, HEAD_DIM=dim, HALF=half, TAIL=tail, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)), HAS_NORM=norm_weight is not None,
            IN_DTYPE=in_dtype and x.dtype != torch.float32,
            # No a * b - c * d contracted into one FMA: each product rounded, as the PyTorch ops round them.
            enable_fp_fusion=False)
    return out
