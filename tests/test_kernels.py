"""The C paged decode-attention kernel against the PyTorch gather + SDPA path, on random paged caches."""
import shutil

import pytest
import torch

from nanoinfer.kernels.cpu import paged_decode_attention_available
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.attention.cpu import CPUAttentionBackend


def decode_metadata(context_lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Decode step over sequences whose blocks are scattered at random through the cache, tables -1 padded."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context_lens]
    blocks = torch.randperm(num_blocks, generator=g)[:sum(per_seq)].tolist()
    width, tables = max(per_seq), []
    for n in per_seq:
        tables.append(blocks[:n] + [-1] * (width - n))
        blocks = blocks[n:]
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=ctx, cu_seqlens_q=torch.arange(len(context_lens) + 1, dtype=torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=max(context_lens), block_size=block_size)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_kernel_builds_where_a_compiler_exists():
    assert paged_decode_attention_available()


@pytest.mark.skipif(not paged_decode_attention_available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", [
    (16, 8, 64, 16, [1, 15, 16, 17, 250, 33]),   # block boundaries, a one-token context
    (4, 4, 32, 4, [7, 1, 64]),                   # MHA
    (12, 3, 40, 8, [9, 100]),                    # 4 query heads per KV head, head_dim not a power of two
    (6, 1, 128, 1, [5, 2, 31]),                  # block size 1, a single KV head
    (8, 2, 64, 16, [2000, 3]),                   # long context next to a short one
])
@pytest.mark.parametrize("window", [None, 1, 7, 40])  # sliding window: only the last `window` positions
def test_decode_kernel_matches_sdpa(heads, kv_heads, head_dim, block_size, context_lens, window):
    meta = decode_metadata(context_lens, block_size, num_blocks=sum(-(-n // block_size) for n in context_lens) + 5,
                           seed=heads + block_size)
    g = torch.Generator().manual_seed(0)
    num_blocks = meta.block_tables.max().item() + 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(context_lens), heads, head_dim, generator=g) * 2  # sharper softmax than N(0, 1)
    scale = head_dim ** -0.5
    kernel, torch_path = CPUAttentionBackend(torch.float32), CPUAttentionBackend(torch.float32)
    torch_path.decode_kernel = False
    for backend in (kernel, torch_path):
        backend.prepare(meta)
    unused = torch.empty(0)  # this step's k, v: only prefill reads them, decode reads the cache
    ours = kernel.forward(q, unused, unused, k_cache, v_cache, meta, scale, window)
    ref = torch_path.forward(q, unused, unused, k_cache, v_cache, meta, scale, window)
    assert ours.shape == ref.shape == (len(context_lens), heads * head_dim)
    err = (ours - ref).abs().max().item()
    assert err < 1e-5, f"max |kernel - SDPA| = {err:.2e}"
    if window is not None:  # the window really changed the result where the context is longer
        full = kernel.forward(q, unused, unused, k_cache, v_cache, meta, scale)
        longer = meta.context_lens > window
        assert torch.equal(longer, (full - ours).abs().amax(1) > 1e-3)


def test_a_failing_build_falls_back_to_pytorch(monkeypatch, tmp_path):
    from nanoinfer.kernels import cpu

    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    cpu._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="falls back to PyTorch"):
            assert not cpu.paged_decode_attention_available()
        assert not CPUAttentionBackend(torch.float32).decode_kernel
    finally:
        cpu._library.cache_clear()
