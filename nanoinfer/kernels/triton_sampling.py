"""Triton kernel for the sampler's race on CUDA: per vocabulary tile, the counter-based noise of
nanoinfer.layers.sampler.exponential_noise (the same integer hash, bit for bit) and the best token of the tile, in one
pass over the logits; no [rows, vocab] tensor besides the logits is written or read."""
import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program takes: 38 tiles a row at Qwen3's 151,936, enough programs at batch 1
NUM_WARPS = 8


@triton.jit
def _mix32(x):
    """sampler._mix32 in uint32, whose products wrap modulo 2^32 natively: the same bits as its int64 products
    masked to 32 bits, in 32-bit multiplies (int64 ones are several instructions each on a GPU)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _gumbel_max_kernel(logits_ptr, temperatures_ptr, keys_ptr, best_ptr, best_idx_ptr, vocab, stride_row,
                       SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf"))
    if SCALE:  # IEEE division, as torch's logits / temperatures: the same floats as the rows Sampler.warp scaled
        x = tl.math.div_rn(x, tl.maximum(tl.load(temperatures_ptr + row), 1e-6))
    # The keys' halves are int64 in [0, 2^32): their low 32 bits, as uint32, are the same values.
    key = _mix32(offs.to(tl.uint32) ^ tl.load(keys_ptr + 2 * row).to(tl.uint32))
    key = _mix32(key ^ tl.load(keys_ptr + 2 * row + 1).to(tl.uint32))
    e = -tl.log(((key >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0))  # exponential_noise's E ~ Exp(1)
    # argmax p / E = argmax log p - log E, and log p is x less the row's log-sum-exp: one pass, no softmax.
    score = tl.where(ok, x - tl.log(e), float("-inf"))
    best = tl.max(score, 0)
    # The first index holding the tile's maximum, as torch.argmax picks (a reduction, so any Triton takes it).
    best_idx = tl.min(tl.where(score == best, offs, vocab), 0)
    out = row * tl.num_programs(1) + tile
    tl.store(best_ptr + out, best)
    tl.store(best_idx_ptr + out, tl.minimum(best_idx, vocab - 1))  # in range even for a NaN row


def gumbel_max(logits: torch.Tensor, temperatures: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """The token each row of logits [B, V] (fp32, unit last stride) draws from softmax(logits / temperatures) —
    or from softmax(logits) where temperatures is None (rows already scaled) — with the rows' noise keys [B, 2]
    int64: argmax logits / temperature - log E over the row's tiles, then over the tiles' winners."""
    rows, vocab = logits.shape
    tiles = triton.cdiv(vocab, BLOCK)
    best = torch.empty(rows, tiles, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, tiles, dtype=torch.int32, device=logits.device)
    if rows:
        scale = temperatures is not None
        _gumbel_max_kernel[(rows, tiles)](logits, temperatures if scale else logits, keys.contiguous(), best,
                                          best_idx, vocab, logits.stride(0), SCALE=scale, BLOCK=BLOCK,
                                          num_warps=NUM_WARPS)
    # argmax takes the first tile of equal winners: the lowest index overall, as one argmax over the row would.
    return best_idx.gather(1, best.argmax(1, keepdim=True)).squeeze(1).long()
