"""Speed of the sampler where the logits are, at batch 256 over Qwen3's vocabulary (151,936): the engine's Sampler
greedy, with temperature alone (on CUDA one pass of the Triton race kernel), with top-k and with top-k and top-p
(Qwen3's generation config: a topk, then the kernel), and with top-p alone (a sort, then the kernel), against vLLM v1's torch ops for temperature (divide, softmax,
exponential_, divide, argmax) and against reading the logits once at the device's copy bandwidth. Medians of
--iters calls. Not a test.

    PYTHONPATH=. python benchmarks/sampler.py [--batch 256] [--vocab 151936] [--device cuda]
    PYTHONPATH=. python benchmarks/sampler.py --device cpu --batch 8 --vocab 4096   # the script's logic on a CPU
"""
import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from nanoinfer.layers.sampler import Sampler, SamplingMetadata, noise_keys


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of fn over iters calls, after two warm-up calls (compilation, allocator)."""
    times = []
    for i in range(iters + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def vllm_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """vLLM v1's random sampling in torch ops (a generator-drawn exponential, not per-request keys)."""
    probs = logits.div(temperatures.unsqueeze(1)).softmax(-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device, b = torch.device(args.device), args.batch
    logits = torch.randn(b, args.vocab, device=device, generator=torch.Generator(device).manual_seed(0)) * 3
    temperatures = torch.full((b,), 0.6, device=device)
    keys = torch.from_numpy(noise_keys(np.arange(b, dtype=np.uint64), np.full(b, 7, dtype=np.uint64))).to(device)
    sampler = Sampler()

    def meta(**kw) -> SamplingMetadata:
        return SamplingMetadata(**{**dict(temperatures=temperatures, top_k=None, top_p=None, all_greedy=False,
                                          all_random=True, noise_keys=keys), **kw})

    greedy = meta(temperatures=torch.zeros(b, device=device), all_greedy=True, all_random=False, noise_keys=None)
    top_k = meta(top_k=torch.full((b,), 50, device=device), max_top_k=50)
    top_k_top_p = meta(top_k=torch.full((b,), 20, device=device), top_p=torch.full((b,), 0.95, device=device),
                       max_top_k=20)
    top_p = meta(top_p=torch.full((b,), 0.9, device=device))
    copy = torch.empty_like(logits)
    gb = logits.numel() * logits.element_size() / 1e9
    # (label, call, GB the rate is over): the copy's bytes read and written; elsewhere the logits' size.
    cases = [
        ("copy of the logits (read + write)", lambda: copy.copy_(logits), 2 * gb),
        ("Sampler, greedy (argmax)", lambda: sampler(logits, greedy), gb),
        ("Sampler, temperature 0.6", lambda: sampler(logits, meta()), gb),
        ("vLLM v1's torch ops, temperature 0.6", lambda: vllm_temperature(logits, temperatures), gb),
        ("Sampler, temperature 0.6 + top-k 50", lambda: sampler(logits, top_k), gb),
        ("Sampler, temperature 0.6 + top-k 20 + top-p 0.95", lambda: sampler(logits, top_k_top_p), gb),
        ("Sampler, temperature 0.6 + top-p 0.9", lambda: sampler(logits, top_p), gb),
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: logits [{b}, {args.vocab}] fp32 ({gb * 1e3:.0f} MB)")
    print(f"| {'case':<48} | {'ms':>8} | {'GB/s':>6} |")
    print(f"|{'-' * 50}|{'-' * 10}|{'-' * 8}|")
    for label, fn, size in cases:
        ms = timed(fn, device, args.iters)
        print(f"| {label:<48} | {ms:8.3f} | {size / ms * 1e3:6.0f} |")


if __name__ == "__main__":
    main()
