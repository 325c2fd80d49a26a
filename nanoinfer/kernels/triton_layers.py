"""Triton kernels for the two elementwise layers of every decoder block on CUDA: fused residual add + RMSNorm,
and SiLU-and-mul. One program per token row; rounding follows the PyTorch layers step by step."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
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
    y = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (y * w).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight, or with a residual: (RMSNorm(x + residual) * weight, x + residual)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    assert x.stride(-1) == 1 and weight.dtype == x.dtype
    rows, n = x.shape
    out = torch.empty_like(x)
    res_in = x if residual is None else residual.reshape(-1, n)
    res_out = out if residual is None else torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), eps, N=n,
                                  BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
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
