"""Speed of the triton attention backend's kernels on a GPU: decode against the device's copy bandwidth, prefill
against torch's own FlashAttention on the same packed prompts. Not a test.

Defaults are Qwen3-0.6B's attention (16 query / 8 KV heads, head_dim 128, bf16, KV blocks of 16): decode at
batch 256 with 1,024-token contexts (K/V bytes read / time, against a device-to-device copy's bytes read +
written / time), and a split-KV decode of a few long contexts; prefill of 32 prompts of U[100, 1024] tokens,
over this step's K/V and over the paged cache, against torch.nn.attention.varlen.varlen_attn (or aten's
_flash_attention_forward on torch versions without it). --sweep also times other decode tile shapes and
segment counts.

    PYTHONPATH=. python benchmarks/attention.py [--batch 256] [--context 1024] [--sweep]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/attention.py --small   # the script's logic on a CPU
"""
import argparse
import inspect
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoinfer.layers.attention import AttentionMetadata, get_backend

BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256, help="decode batch (default 256)")
    p.add_argument("--context", type=int, default=1024, help="decode context length (default 1024)")
    p.add_argument("--long-batch", type=int, default=4, help="split-KV decode batch (default 4)")
    p.add_argument("--long-context", type=int, default=16384, help="split-KV decode context (default 16384)")
    p.add_argument("--prompts", type=int, default=32, help="prefill prompts (default 32)")
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--sweep", action="store_true",
                   help="also time 29 decode tile shapes / segment counts, print the fastest 5")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes on the CPU (run with TRITON_INTERPRET=1): checks the script, not the speed")
    args = p.parse_args()
    if args.small:
        args.batch, args.context, args.long_batch, args.long_context = 4, 40, 1, 300
        args.prompts, args.min_prompt, args.max_prompt, args.heads, args.kv_heads, args.head_dim = 3, 5, 40, 4, 2, 32
    return args


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median seconds per call: triton's do_bench (CUDA events, cache flushed) on a GPU, wall time on a CPU."""
    if device.type == "cuda":
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def wall(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    return wall


def copy_bandwidth(time_fn, device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy: the ceiling for a kernel that streams."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_fn(lambda: dst.copy_(src))


def paged(lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
          g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches holding sequences of these lengths in shuffled blocks, and their block tables."""
    counts = [-(-n // BLOCK_SIZE) for n in lengths]
    order = torch.randperm(sum(counts), generator=g).to(torch.int32)
    tables = torch.full((len(lengths), max(counts)), -1, dtype=torch.int32)
    for i, (count, start) in enumerate(zip(counts, offsets(counts, torch.device("cpu")).tolist())):
        tables[i, :count] = order[start:start + count]
    shape = (sum(counts), BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    return k_cache, v_cache, tables.to(device)


def offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def metadata(q_lens: list[int], contexts: list[int], tables: torch.Tensor, device: torch.device,
             has_cached_prefix: bool) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=None, block_tables=tables,
                             context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
                             cu_seqlens_q=offsets(q_lens, device), cu_seqlens_k=offsets(contexts, device),
                             max_seqlen_q=max(q_lens),
                             max_seqlen_k=max(contexts), block_size=BLOCK_SIZE, has_cached_prefix=has_cached_prefix)


def kv_bytes(contexts: list[int], kv_heads: int, head_dim: int, itemsize: int) -> int:
    """What decode must read: every context's keys and values once."""
    return 2 * sum(contexts) * kv_heads * head_dim * itemsize


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> int:
    """Q @ K^T and P @ V over the visible (lower-triangle) scores: 2 matmuls x 2 flops per multiply-add."""
    return 4 * heads * head_dim * sum(n * (n + 1) // 2 for n in lengths)


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
                ) -> tuple[str, Callable[[], torch.Tensor]] | None:
    """torch's FlashAttention-2 on packed varlen prompts, causal, GQA as is; None on a CPU."""
    if q.device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return "aten._flash_attention_forward", lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0]
    # torch 2.10 took is_causal; 2.11 took a (left, right) window instead.
    causal = dict(window_size=(-1, 0)) if "window_size" in inspect.signature(varlen_attn).parameters \
        else dict(is_causal=True)
    return "varlen_attn", lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """One causal SDPA per prompt (slow, for the correctness check on a CPU)."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1).unsqueeze(0).float() for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0]
                    .transpose(0, 1).to(q.dtype))
        start += n
    return torch.cat(outs)


def decode_rows(args, time_fn, backend, dtype, device, g, copy_bw) -> list[tuple[str, float, str, str]]:
    rows = []
    for batch, context in ((args.batch, args.context), (args.long_batch, args.long_context)):
        contexts = [context] * batch
        k_cache, v_cache, tables = paged(contexts, args.kv_heads, args.head_dim, dtype, device, g)
        q = torch.randn(batch, args.heads, args.head_dim, generator=g).to(dtype).to(device)
        meta = metadata([1] * batch, contexts, tables, device, True)
        seconds = time_fn(lambda: backend.forward(q, None, None, k_cache, v_cache, meta, args.head_dim ** -0.5))
        bandwidth = kv_bytes(contexts, args.kv_heads, args.head_dim, dtype.itemsize) / seconds
        segments = backend.num_segments(batch, args.kv_heads)
        rows.append((f"decode b={batch} ctx={context} ({segments} segment{'s' * (segments > 1)})", seconds,
                     f"{bandwidth / 1e9:,.1f} GB/s", f"{bandwidth / copy_bw:.0%} of copy"))
    return rows


def prefill_rows(args, time_fn, backend, dtype, device, g) -> list[tuple[str, float, str, str]]:
    rng = random.Random(0)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.prompts)]
    total, scale = sum(lengths), args.head_dim ** -0.5
    q = torch.randn(total, args.heads, args.head_dim, generator=g).to(dtype).to(device)
    k, v = (torch.randn(total, args.kv_heads, args.head_dim, generator=g).to(dtype).to(device) for _ in range(2))
    k_cache, v_cache, tables = paged(lengths, args.kv_heads, args.head_dim, dtype, device, g)
    host_tables = tables.cpu()
    slots = torch.cat([host_tables[i, torch.arange(n) // BLOCK_SIZE].long() * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE
                       for i, n in enumerate(lengths)])
    backend.store_kvcache(k, v, k_cache, v_cache, slots.to(device))
    flops = causal_flops(lengths, args.heads, args.head_dim)
    runs = {"this step's K/V": metadata(lengths, lengths, tables, device, False),
            "the paged cache": metadata(lengths, lengths, tables, device, True)}
    flash = torch_flash(q, k, v, runs["this step's K/V"].cu_seqlens_q, max(lengths), scale)
    reference = flash[1]() if flash else sdpa_reference(q, k, v, lengths, scale)
    flash_seconds = time_fn(flash[1]) if flash else None
    rows = []
    for name, meta in runs.items():
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        err = ((out.float() - reference.flatten(1).float()).abs().max() / reference.float().abs().max()).item()
        seconds = time_fn(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale))
        versus = f"{seconds / flash_seconds:.2f}x torch's time" if flash else "no torch flash on a CPU"
        rows.append((f"prefill over {name} (rel. err {err:.1e})", seconds, f"{flops / seconds / 1e12:,.1f} TFLOP/s",
                     versus))
    if flash:
        rows.append((f"prefill, torch {flash[0]}", flash_seconds, f"{flops / flash_seconds / 1e12:,.1f} TFLOP/s", ""))
    return rows


def sweep_rows(args, time_fn, dtype, device, g, copy_bw) -> list[tuple[str, float, str, str]]:
    """The batch-256 decode with other tile shapes and segment counts than the backend picks: the fastest five."""
    from nanoinfer.kernels.triton_attention import DecodePartials, TileConfig, decode_attention, decode_config
    contexts = [args.context] * args.batch
    k_cache, v_cache, tables = paged(contexts, args.kv_heads, args.head_dim, dtype, device, g)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(dtype).to(device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    default = decode_config(args.heads // args.kv_heads, args.head_dim, dtype.itemsize)
    partials = DecodePartials.allocate(args.batch * 4, args.heads, args.head_dim, device)
    shapes = [(TileConfig(default.block_m, block_n, warps, stages), 1)
              for block_n in (32, 64, 128) for warps in (2, 4, 8) for stages in (2, 3, 4)]
    shapes += [(default, 2), (default, 4)]
    rows = []
    for config, segments in shapes:
        seconds = time_fn(lambda: decode_attention(q, k_cache, v_cache, tables, lens, 0.1, None, segments, partials,
                                                   config))
        bandwidth = kv_bytes(contexts, args.kv_heads, args.head_dim, dtype.itemsize) / seconds
        rows.append((f"  decode: {config.block_n}-key tiles, {config.num_warps} warps, {config.num_stages} stages, "
                     f"{segments} segment(s)", seconds, f"{bandwidth / 1e9:,.1f} GB/s",
                     f"{bandwidth / copy_bw:.0%} of copy"))
    return sorted(rows, key=lambda r: r[1])[:5]


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --small with TRITON_INTERPRET=1 to check the script on a CPU)")
    dtype = getattr(torch, args.dtype)
    time_fn = timer(device)
    backend = get_backend("triton", dtype, device)
    g = torch.Generator().manual_seed(0)
    copy_bytes = (1 << 30) if device.type == "cuda" else (1 << 20)
    copy_bw = copy_bandwidth(time_fn, device, copy_bytes)
    rows = [(f"device-to-device copy of {copy_bytes >> 20} MiB (read + write)", 2 * copy_bytes / copy_bw,
             f"{copy_bw / 1e9:,.1f} GB/s", "")]
    rows += decode_rows(args, time_fn, backend, dtype, device, g, copy_bw)
    rows += prefill_rows(args, time_fn, backend, dtype, device, g)
    if args.sweep:
        rows += sweep_rows(args, time_fn, dtype, device, g, copy_bw)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}, {args.dtype}, {args.heads} q / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"KV blocks of {BLOCK_SIZE}")
    width = max(len(r[0]) for r in rows)
    for label, seconds, rate, note in rows:
        print(f"{label:<{width}}  {seconds * 1e3:9.3f} ms  {rate:>15}  {note}")


if __name__ == "__main__":
    main()
