"""Triton kernel for the sampler's counter-based Exp(1) noise on CUDA: one pass writing what
nanoinfer.layers.sampler.exponential_noise computes with ~20 torch ops (the same integer hash, bit for bit)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """sampler._mix32 on int64 values in [0, 2^32)."""
    mask = tl.full((), 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & mask
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & mask
    return x ^ (x >> 15)


@triton.jit
def _exponential_noise_kernel(keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(keys_ptr + 2 * row)
    hi = tl.load(keys_ptr + 2 * row + 1)
    x = _mix32(offs.to(tl.int64) ^ lo)
    x = _mix32(x ^ hi)
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    tl.store(out_ptr + row.to(tl.int64) * vocab + offs, -tl.log(u), mask=offs < vocab)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab] fp32 of rows keyed by keys [B, 2] int64."""
    keys = keys.contiguous()
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    block = 1024
    if keys.shape[0]:
        _exponential_noise_kernel[(keys.shape[0], triton.cdiv(vocab, block))](keys, out, vocab, BLOCK=block)
    return out
