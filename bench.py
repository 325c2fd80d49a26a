"""Offline throughput benchmark for nanoinfer: nano-vllm's bench.py on CUDA, and a workload scaled for a CPU.

On CUDA (--device cuda, or by itself where a GPU is visible): nano-vllm's benchmark exactly: a random
Qwen3-0.6B (bf16), 256 prompts of random ids with lengths uniform in [100, 1024], outputs uniform in [100, 1024],
temperature 0.6, ignore_eos, drawn as nano-vllm draws them after seed(0); output tok/s. --compare-hf runs
transformers `generate` (dynamic cache, bf16, batch 64) and nanoinfer on 64 prompts x 256 greedy tokens;
--profile times a decode step at batch 256 against its bandwidth floor. A table ends the run. --dry-run runs
that code at toy size on any device (a smoke test: its numbers mean nothing).

On the CPU:

Measures, for a batch of random-token prompts generated greedily with ignore_eos:
  * wall time, output tok/s and total (prompt + output) tok/s;
  * time spent in prefill vs decode steps (the engine is stepped here, one timed step at a time);
  * achieved GFLOP/s of the linear layers (qkv/o/gate_up/down + LM head) and its fraction of the
    fp32 matmul peak (best of F.linear and the oneDNN-packed path the engine uses) measured in the same process;
  * optionally (--compare-hf) the same workload through transformers' batched `generate`.

The default model is a random-weight Qwen3 (~133.5M params) built once and cached under
<nanoinfer cache>/bench-qwen3-<config hash>; --model takes any model dir or .gguf instead.

    PYTHONPATH=. python bench.py [--num-seqs 64] [--output-len 128] [--tp 2] [--compare-hf [--hf-static]]
                                 [--json out.json]
    PYTHONPATH=. python bench.py --device cuda [--compare-hf] [--profile] [--time-limit 300]
"""
import argparse
import gc
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from transformers.utils import logging as hf_logging

from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.kernels.cuda import compiled_variants
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.linear import LinearBase, linear, pack_weight
from nanoinfer.utils.default_model import cache_dir

BENCH_QWEN3 = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=64, intermediate_size=3072, vocab_size=32000, tie_word_embeddings=True,
                   max_position_embeddings=4096)
WEIGHT_SEED = 0
# Qwen3-0.6B's shapes (nano-vllm benchmarks that model), random weights in bf16.
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=40960)
# --dry-run: the same code on a toy model whose vocabulary still holds nano-vllm's token ids (0..10000).
TOY_QWEN3 = dict(QWEN3_0_6B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=10240)


@dataclass
class GPUWorkload:
    num_seqs: int = 256  # nano-vllm's bench.py
    max_input_len: int = 1024
    max_output_len: int = 1024
    greedy_seqs: int = 64  # --compare-hf: a fixed greedy workload, transformers' batch size
    greedy_output_len: int = 256
    profile_batch: int = 256  # --profile


TOY_WORKLOAD = GPUWorkload(num_seqs=8, max_input_len=128, max_output_len=104, greedy_seqs=4, greedy_output_len=8,
                           profile_batch=8)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model dir or .gguf (default: a cached random Qwen3, ~133.5M params)")
    p.add_argument("--num-seqs", type=int, default=64, help="number of prompts (default 64)")
    p.add_argument("--min-input", type=int, default=32, help="shortest prompt (default 32)")
    p.add_argument("--max-input", type=int, default=256, help="longest prompt (default 256)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--random-output", action="store_true", help="output lengths uniform in [1, output-len]")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size: ranks share the cores (default 1)")
    p.add_argument("--max-num-seqs", type=int, help="engine max_num_seqs (default: --num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine max_num_batched_tokens (default: engine's)")
    p.add_argument("--num-kvcache-blocks", type=int, help="engine num_kvcache_blocks (default: engine's)")
    p.add_argument("--compare-hf", action="store_true", help="also run transformers generate on the same prompts")
    p.add_argument("--ngram", type=int, metavar="K",
                   help="CPU: also run with n-gram speculative decoding, K drafts a step, and compare with the plain run")
    p.add_argument("--repetitive", action="store_true",
                   help="each prompt a random block of 8-32 tokens repeated (a workload that copies its context)")
    p.add_argument("--hf-batch-size", type=int, help="HF generate batch size (default: all prompts in one batch)")
    p.add_argument("--hf-static", action="store_true", help='HF generate with cache_implementation="static"')
    p.add_argument("--profile", action="store_true",
                   help="after the timed run, profile full-batch decode steps: matmuls vs attention vs the rest")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: nano-vllm's benchmark (the CPU workload options above do not apply); auto: cuda "
                        "where a GPU is visible")
    p.add_argument("--dry-run", action="store_true",
                   help="the CUDA benchmark's code at toy size, on --device (the CPU too): a smoke test")
    p.add_argument("--attention-backend", default="auto", help="CUDA: engine attention_backend (default auto)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument("--async-scheduling", action="store_true",
                   help="CUDA: engine async_scheduling (each step scheduled while the previous one runs)")
    p.add_argument("--also-async", action="store_true",
                   help="CUDA: then nano-vllm's workload again with async scheduling, on a second engine")
    p.add_argument("--time-limit", type=float, default=600,
                   help="CUDA: seconds each nanoinfer run may take before it is cut short and reported as such")
    return p.parse_args()


def bench_model(spec: dict = BENCH_QWEN3, dtype: str = "float32", device: str = "cpu") -> Path:
    """A random Qwen3 of shapes `spec`, built (seeded, on `device`) and saved as safetensors on first use."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    key = json.dumps({**spec, "dtype": dtype, "seed": WEIGHT_SEED}, sort_keys=True)
    path = cache_dir() / f"bench-qwen3-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path
    print(f"building random Qwen3 in {path} ...", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(WEIGHT_SEED)
    with torch.device(device):  # random initialisation of 0.6B parameters is much faster on a GPU
        model = Qwen3ForCausalLM(Qwen3Config(**spec, dtype=dtype))
    model = model.to("cpu", getattr(torch, dtype))
    tmp = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    model.save_pretrained(tmp)
    for f in [tmp, *Path(tmp).iterdir()]:  # mkdtemp makes 0700 dirs; the cache may be shared
        os.chmod(f, 0o755 if Path(f).is_dir() else 0o644)
    try:
        os.rename(tmp, path)  # atomic; fails harmlessly if a concurrent run got there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randint(0, vocab_size - 1) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_seqs)]
    if args.repetitive:  # a trained model continues such a prompt by copying it: n-gram drafts get accepted
        prompts = [(p[:rng.randint(8, 32)] * len(p))[:len(p)] for p in prompts]
    out_lens = [rng.randint(1, args.output_len) if args.random_output else args.output_len for _ in prompts]
    return prompts, out_lens


def matmul_gflops(m: int, k: int, n: int, packed: bool, trials: int = 5, min_time: float = 0.1) -> float:
    """Best-of-`trials` fp32 throughput of x[m, k] @ w[n, k]^T (best-of: the machine may be shared), either
    with plain F.linear or with the oneDNN-packed weights the engine uses.

    Calls rotate over enough distinct weights (>= 64 MB) that they cannot all stay in the CPU caches,
    as in a real forward pass, where every layer's weights are streamed from memory once per step; at most 64
    (toy shapes, as the tests run, would otherwise need thousands of calls per timing, each stalling under load).
    """
    x = torch.randn(m, k)
    ws = [torch.randn(n, k) for _ in range(min(64, -(-(64 << 20) // (4 * n * k))))]
    packs = [pack_weight(w, 64) if packed else None for w in ws]

    def run(iters: int) -> float:
        t = time.perf_counter()
        for i in range(iters):
            linear(x, ws[i % len(ws)], None, packs[i % len(ws)])
        return (time.perf_counter() - t) / iters

    run(len(ws))
    iters = len(ws)
    while (dt := run(iters)) * iters < min_time:  # long enough to time reliably
        iters *= 2
    best = min([dt] + [run(iters) for _ in range(trials - 1)])
    return 2 * m * k * n / best / 1e9


def run_ours(llm: LLM, prompts: list[list[int]], out_lens: list[int], linear_params: int, head_params: int) -> dict:
    """Drive the engine step by step, timing each step and counting its linear-layer FLOPs.

    FLOPs of a dense layer = 2 * weight elements * rows it is applied to. Every token a step computes
    (a prompt token, a prompt chunk, a recomputed token after preemption, or a decode token; not a
    prefix-cache hit) goes through every decoder linear layer, so those cost 2 * linear_params * computed
    tokens. The LM head runs only on rows whose next token is sampled (the last position of a prompt that
    finishes prefill, and every decode row), so it costs 2 * head_params * sampled tokens. A step that
    computes any prompt chunk (possibly alongside decode rows) counts as prefill.
    Attention's score/value products (not linear layers) and biases are not counted.
    """
    engine = llm.llm_engine
    stats = {k: dict(steps=0, time=0.0, tokens=0, sampled=0) for k in ("prefill", "decode")}
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                     output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = [None] * len(prompts)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        finished = engine.step()
        dt = time.perf_counter() - t
        batch = engine.last_batch
        s = stats["prefill" if batch.is_prefill else "decode"]
        s["steps"] += 1
        s["time"] += dt
        s["tokens"] += sum(batch.num_new_tokens)
        s["sampled"] += sum(batch.samples)
        for out in finished:
            outputs[int(out.request_id)] = out.outputs[0].token_ids
    wall = time.perf_counter() - t0
    for s in stats.values():
        s["gflop"] = 2 * (linear_params * s["tokens"] + head_params * s["sampled"]) / 1e9
        s["gflops"] = s["gflop"] / s["time"] if s["time"] else 0.0
    assert [len(o) for o in outputs] == out_lens, "engine produced the wrong number of tokens"
    return dict(wall=wall, outputs=outputs, steps=stats, preemptions=engine.scheduler.num_preemptions)


def profile_decode(llm: LLM, prompts: list[list[int]], warm_steps: int = 48, steps: int = 16) -> dict:
    """Where a decode step at full batch goes, a third to two thirds of the way into 128 output tokens
    (around the mean context of the workload's decode steps): `steps` steps are timed plainly, then as many
    under torch.profiler, which gives the time inside matmuls (oneDNN or F.linear, LM head included), the C
    attention kernel and the other C kernels (norms, rotary, SiLU, KV store, argmax); the rest (sampling,
    building inputs, scheduling, Python, and the profiler's own overhead) is the profiled step minus those."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", p,
                           SamplingParams(temperature=0, max_tokens=warm_steps + 2 * steps + 2, ignore_eos=True))
    engine.step()
    while engine.last_batch.is_prefill:
        engine.step()
    for _ in range(warm_steps):
        engine.step()

    def timed_steps() -> list[float]:
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        return walls

    plain = timed_steps()
    batch_size = len(engine.scheduler.running)
    context = sum(map(len, engine.scheduler.running)) / batch_size
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = timed_steps()
    engine.abort_all()
    ms = {"matmul": 0.0, "attention": 0.0, "small_ops": 0.0}
    for e in prof.key_averages():
        kind = ("matmul" if e.key in ("mkldnn::_linear_pointwise", "aten::linear") else
                "attention" if e.key == "nanoinfer::paged_decode_attention" else
                "small_ops" if e.key.startswith("nanoinfer::") else None)
        if kind:
            ms[kind] += e.cpu_time_total / 1e3 / steps
    step = sum(profiled) / steps * 1e3  # a mean, like the category times
    return dict(batch=batch_size, context=context, plain_step_ms=sorted(plain)[steps // 2] * 1e3, step_ms=step,
                **{f"{k}_ms": v for k, v in ms.items()}, rest_ms=step - sum(ms.values()),
                ratio=step / ms["matmul"] if ms["matmul"] else float("nan"))


def run_hf(model: str, prompts: list[list[int]], out_lens: list[int], batch_size: int, static: bool,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """transformers batched greedy generate, left-padded with token 0 (masked out)."""
    from transformers import AutoModelForCausalLM
    path = Path(model)
    kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=dtype, **kw).to(device).eval()

    def generate(batch: list[list[int]], n: int, cache: str | None) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, cache_implementation=cache)
        return out[:, width:].tolist()

    cache = "static" if static else None
    warm = [[1, 2, 3, 4, 5, 6, 7, 8]] * 2
    try:  # warm-up; also tells whether the static cache works here
        generate(warm, 4, cache)
    except Exception as e:  # noqa: BLE001 - report and fall back
        if not static:
            raise
        print(f"HF static cache failed ({type(e).__name__}: {e}); falling back to the dynamic cache")
        cache = None
        generate(warm, 4, cache)
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        # A batch generates its longest requested length for every row (static batching; only matters
        # with --random-output); only the requested tokens are kept and counted.
        lens = out_lens[i:i + batch_size]
        outputs += [o[:m] for o, m in zip(generate(prompts[i:i + batch_size], max(lens), cache), lens)]
    return dict(wall=time.perf_counter() - t0, outputs=outputs, cache=cache or "dynamic")


def nano_vllm_workload(num_seqs: int, max_input_len: int, max_output_len: int,
                       seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts and max_tokens drawn as nano-vllm's bench.py draws them after seed(0): each prompt's length, then its
    tokens, prompt after prompt; then each request's max_tokens. Random(0) draws what seed(0) + randint draw."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)]
    return prompts, [rng.randint(100, max_output_len) for _ in range(num_seqs)]


def greedy_prompts(work: GPUWorkload) -> list[list[int]]:
    """--compare-hf's prompts, drawn as the benchmark's after seed(1): not its first ones (seed 0's), which the
    engine's prefix cache still holds when the greedy run comes, and transformers' generate has no such cache."""
    return nano_vllm_workload(work.greedy_seqs, work.max_input_len, work.max_output_len, seed=1)[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, trials: int = 10) -> float:
    """Bytes moved (read + written) per second by the best of `trials` device-to-device copies of nbytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(trials):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def run_requests(llm: LLM, name: str, prompts: list[list[int]], params: list[SamplingParams],
                 time_limit: float) -> dict:
    """Drive the engine until every request is done or time_limit seconds have passed (the rest is aborted and
    the run reported as cut short): wall time, output tokens, each finished request's tokens."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{name}-{i}", p, sp)
    outputs: list[list[int] | None] = [None] * len(prompts)
    cut_short = False
    while engine.has_unfinished_requests():
        if time.perf_counter() - t0 > time_limit:
            cut_short = True
            break
        for out in engine.step():
            outputs[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0].token_ids
    wall = time.perf_counter() - t0
    partial = sum(s.num_completion_tokens for seqs in engine.requests.values() for s in seqs)
    engine.abort_all()
    done = [o for o in outputs if o is not None]
    return dict(wall=wall, outputs=outputs, output_tokens=sum(map(len, done)) + partial, finished=len(done),
                cut_short=cut_short)


def weight_bytes(net: torch.nn.Module) -> int:
    """Bytes of the weights a forward pass reads (a tied LM head counted once; packed CPU weights included)."""
    packed = [m.packed_weight for m in net.modules() if isinstance(m, LinearBase) and m.packed_weight is not None]
    return sum(t.numel() * t.element_size() for t in [*net.parameters(), *packed])


def profile_decode_gpu(llm: LLM, prompts: list[list[int]], batch: int, bandwidth: float, time_limit: float,
                       warm_steps: int = 8, steps: int = 16) -> dict | None:
    """A decode step at `batch` sequences (nano-vllm's prompts, temperature 0.6) against its floor: the weights plus
    the KV cache it reads, over the measured copy bandwidth. The GPU's busy time per step comes from
    torch.profiler (CUDA kernels and copies); the rest of a step's wall time is the host's, not overlapped. A step's
    wall time is the mean over `steps` consecutive ones, the device synchronized only around them: with async
    scheduling, the host's work that overlaps the device's does not count. None if the prompts are not prefilled
    within time_limit seconds."""
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    device = runner.device
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512, output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(f"profile-{i}", prompts[i % len(prompts)], params)
    t0 = time.perf_counter()
    engine.step()
    while engine.last_batch.is_prefill:
        if time.perf_counter() - t0 > time_limit:
            engine.abort_all()
            return None
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    kv_token_bytes = sum(2 * a.num_kv_heads * a.head_dim * a.k_cache.element_size()
                         for a in runner.model.modules() if isinstance(a, Attention))
    kv_tokens = []
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        kv_tokens.append(sum(map(len, engine.scheduler.running)))  # each context, with the token this step adds
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    real_batch = len(engine.last_batch.seqs)
    device_ms = math.nan
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync(device)
        # Kernels and copies are events of their own (device_type CUDA); CPU ops only attribute them again.
        busy = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
        device_ms = busy / 1e3 / steps if busy else math.nan
    engine.abort_all()
    weights, kv = weight_bytes(runner.model), statistics.mean(kv_tokens) * kv_token_bytes
    floor_ms = (weights + kv) / bandwidth * 1e3
    return dict(batch=real_batch, context=statistics.mean(kv_tokens) / real_batch, step_ms=step_ms,
                weight_bytes=weights, kv_bytes=kv, floor_ms=floor_ms, ratio=step_ms / floor_ms, device_ms=device_ms,
                host_ms=step_ms - device_ms)


def start_engine(model: str, device: torch.device, args: argparse.Namespace, async_scheduling: bool) -> LLM:
    """The benchmark's engine, its settings printed, warmed up as nano-vllm's bench warms up."""
    llm = LLM(model, max_model_len=4096, seed=0, device=device.type, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, async_scheduling=async_scheduling,
              max_num_seqs=args.max_num_seqs or 256,
              max_num_batched_tokens=args.max_num_batched_tokens, num_kvcache_blocks=args.num_kvcache_blocks)
    cfg = llm.llm_engine.config
    print(f"engine: {cfg.attention_backend} attention, {cfg.torch_dtype}, block {cfg.kvcache_block_size}, "
          f"{llm.llm_engine.model_runner.num_kvcache_blocks} KV blocks, CUDA graphs "
          f"{llm.llm_engine.model_runner.graph_runner is not None}, async scheduling {cfg.async_scheduling}")
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=16), use_tqdm=False)  # nano-vllm's warm-up
    return llm


def nano_vllm_run(llm: LLM, prompts: list[list[int]], max_tokens: list[int], work: GPUWorkload, time_limit: float,
                  label: str = "") -> tuple[dict, tuple[str, str]]:
    """nano-vllm's workload on llm, timed as nano-vllm times it: its result and its row of the table."""
    compiled = sum(compiled_variants().values())
    ours = run_requests(llm, "bench", prompts, [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, output_kind=RequestOutputKind.FINAL_ONLY)
        for m in max_tokens], time_limit)
    compiled = sum(compiled_variants().values()) - compiled  # each ~1 s of the timed run on a cold Triton cache
    tok_s = ours["output_tokens"] / ours["wall"]
    short = f" (cut short at {time_limit:.0f} s: {ours['finished']} of {len(prompts)} done)" if ours["cut_short"] else ""
    print(f"nano-vllm workload{label}: {ours['output_tokens']} output tokens in {ours['wall']:.2f}s = {tok_s:.1f} "
          f"tok/s{short}; Triton kernel variants compiled during it: {compiled}")
    print(f"Total: {ours['output_tokens']}tok, Time: {ours['wall']:.2f}s, Throughput: {tok_s:.2f}tok/s")  # its words
    result = dict(wall_s=ours["wall"], output_tokens=ours["output_tokens"], output_tok_s=tok_s,
                  finished=ours["finished"], cut_short=ours["cut_short"], kernels_compiled=compiled)
    return result, (f"nano-vllm workload{label} ({len(prompts)} seqs, in/out U[100,{work.max_input_len}]/U[100,"
                    f"{work.max_output_len}], T=0.6)", f"{ours['wall']:.2f} s, **{tok_s:,.0f} output tok/s**{short}")


def decode_profile(llm: LLM, prompts: list[list[int]], batch: int, bandwidth: float, time_limit: float
                   ) -> tuple[dict | None, list[tuple[str, str]]]:
    """profile_decode_gpu's result, printed, and its rows of the table; a failure of the profiler (over replayed
    graphs: a known hazard of some torch versions) is reported, not raised: the rest of the benchmark stands."""
    try:
        d = profile_decode_gpu(llm, prompts, batch, bandwidth, time_limit)
    except Exception as e:  # noqa: BLE001 - a diagnostic
        return None, [(f"decode step, batch {batch}", f"not measured: the profiler failed ({e!r})")]
    if d is None:
        return None, [(f"decode step, batch {batch}", f"not measured: prefill took over {time_limit:.0f} s")]
    print(f"decode step at batch {d['batch']} (mean context {d['context']:.0f}): {d['step_ms']:.2f} ms | "
          f"floor {d['floor_ms']:.2f} ms (weights {d['weight_bytes'] / 1e9:.2f} GB + KV "
          f"{d['kv_bytes'] / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s) = {d['ratio']:.2f}x | GPU busy "
          f"{d['device_ms']:.2f} ms, host (not overlapped) {d['host_ms']:.2f} ms")
    return d, [(f"decode step, batch {d['batch']}, mean context {d['context']:.0f}",
                f"{d['step_ms']:.2f} ms vs floor {d['floor_ms']:.2f} ms = **{d['ratio']:.2f}x**"),
               ("host time per decode step (wall - GPU busy)", f"{d['host_ms']:.2f} ms")]


def main_gpu(args: argparse.Namespace, device: torch.device) -> None:
    """nano-vllm's benchmark (and --compare-hf, --profile) on `device`; at toy size with --dry-run."""
    spec, work = (TOY_QWEN3, TOY_WORKLOAD) if args.dry_run else (QWEN3_0_6B, GPUWorkload())
    model = args.model or str(bench_model(spec, "bfloat16", device.type))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"model: {model} | device: {name} | torch {torch.__version__}{' | dry run (toy sizes)' if args.dry_run else ''}")
    prompts, max_tokens = nano_vllm_workload(work.num_seqs, work.max_input_len, work.max_output_len)
    greedy = greedy_prompts(work)
    result: dict = dict(model=model, device=name, torch=torch.__version__, args=vars(args))
    rows = [("device", f"{name}, torch {torch.__version__}")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # transformers' (the engine's: its "auto")
    if args.compare_hf:  # first, while the GPU is free: the engine's KV cache takes what transformers leaves
        hf = run_hf(model, greedy, [work.greedy_output_len] * len(greedy), len(greedy), False, dtype, device.type)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Measured before the engine takes the GPU's memory.
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    llm = start_engine(model, device, args, args.async_scheduling)
    result["nano_vllm"], row = nano_vllm_run(llm, prompts, max_tokens, work, args.time_limit)
    rows.append(row)

    if args.compare_hf:
        n = work.greedy_output_len
        mine = run_requests(llm, "greedy", greedy, [
            SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, output_kind=RequestOutputKind.FINAL_ONLY)
        ] * len(greedy), args.time_limit)
        pairs = [(a, b) for a, b in zip(mine["outputs"], hf["outputs"]) if a is not None]
        same = sum(a == b for a, b in pairs)
        common = statistics.mean(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n) for a, b in pairs) \
            if pairs else math.nan
        print(f"greedy {len(greedy)} x {n}: nanoinfer {mine['wall']:.2f}s | transformers ({hf['cache']} cache, batch "
              f"{len(greedy)}) {hf['wall']:.2f}s | {hf['wall'] / mine['wall']:.2f}x | identical {same}/{len(pairs)}, "
              f"mean common prefix {common:.0f} tokens")
        result["greedy"] = dict(nanoinfer_s=mine["wall"], hf_s=hf["wall"], ratio=hf["wall"] / mine["wall"],
                                identical=same, mean_common_prefix=common, cut_short=mine["cut_short"])
        rows.append((f"greedy {len(greedy)} x {n}: nanoinfer / transformers generate ({str(dtype)[6:]}, "
                     f"{hf['cache']} cache)",
                     f"{mine['wall']:.2f} s / {hf['wall']:.2f} s = **{hf['wall'] / mine['wall']:.2f}x**"
                     f"{' (nanoinfer cut short)' if mine['cut_short'] else ''}"))

    if args.profile:
        result["decode_profile"], profile_rows = decode_profile(llm, prompts, work.profile_batch, bandwidth,
                                                                args.time_limit)
        rows += profile_rows
    llm.close()
    if args.also_async:  # a second engine in this process: the model, the Triton kernels and the workload at hand
        llm = start_engine(model, device, args, True)
        result["nano_vllm_async"], row = nano_vllm_run(llm, prompts, max_tokens, work, args.time_limit,
                                                       " (async scheduling)")
        rows.append(row)
        llm.close()
    print("\n| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")


def main() -> None:
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.py: --device cuda, but torch sees no CUDA device")
    device = torch.device("cuda" if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available()
                          else "cpu")
    if device.type == "cuda" or args.dry_run:
        return main_gpu(args, device)
    model = args.model or str(bench_model())
    llm = LLM(model, max_model_len=args.max_input + args.output_len, device="cpu",
              max_num_seqs=args.max_num_seqs or args.num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_kvcache_blocks=args.num_kvcache_blocks,
              enable_prefix_caching=True, seed=0, tensor_parallel_size=args.tp)
    engine, threads = llm.llm_engine, torch.get_num_threads()
    net, cfg = engine.model_runner.model, engine.config.hf_config
    # Packed linear layers keep their weights outside the parameters; a tied LM head is counted once. Every
    # decoder linear layer is split across the ranks (exactly, unless KV heads are replicated), so x tp.
    linear_params = args.tp * sum((m.weight if m.packed_weight is None else m.packed_weight).numel()
                                  for m in net.modules() if isinstance(m, LinearBase))
    num_params = sum(p.numel() for p in net.parameters()) + sum(
        m.packed_weight.numel() for m in net.modules() if isinstance(m, LinearBase) and m.packed_weight is not None)
    head_params = cfg.vocab_size * cfg.hidden_size
    ecfg = engine.config
    print(f"model: {model}")
    per_rank = " per rank" if args.tp > 1 else ""
    print(f"params{per_rank}: {num_params / 1e6:.2f}M | whole model: decoder linear {linear_params / 1e6:.2f}M, "
          f"LM head {head_params / 1e6:.2f}M | tp {args.tp}, threads{per_rank}: {threads} | max_num_seqs "
          f"{ecfg.max_num_seqs}, max_num_batched_tokens {ecfg.max_num_batched_tokens}, "
          f"kv blocks {engine.model_runner.num_kvcache_blocks}")

    prompts, out_lens = make_workload(args, cfg.vocab_size)
    num_prompt, num_output = sum(map(len, prompts)), sum(out_lens)
    print(f"workload: {len(prompts)} seqs, input {args.min_input}-{args.max_input} ({num_prompt} tokens), "
          f"output {'1-' if args.random_output else ''}{args.output_len} ({num_output} tokens)")

    warm = random.Random(1)
    llm.generate([[warm.randint(0, cfg.vocab_size - 1) for _ in range(args.min_input)] for _ in range(2)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    k, n = cfg.hidden_size, cfg.intermediate_size
    plain = {m: matmul_gflops(m, k, n, packed=False) for m in (64, 256)}
    peak = {m: max(plain[m], matmul_gflops(m, k, n, packed=True)) for m in (64, 256)}
    if args.tp > 1:  # measured with one rank's threads; the ranks together have tp times as many
        plain, peak = ({m: args.tp * v[m] for m in v} for v in (plain, peak))
    ranks = f" x {args.tp} ranks" if args.tp > 1 else ""
    print(f"matmul fp32{ranks}, K={k} N={n}: F.linear M=64 {plain[64]:.1f}, M=256 {plain[256]:.1f} GFLOP/s | "
          f"peak (best of F.linear and oneDNN-packed) M=64 {peak[64]:.1f}, M=256 {peak[256]:.1f} GFLOP/s")

    ours = run_ours(llm, prompts, out_lens, linear_params, head_params)
    pre, dec, wall = ours["steps"]["prefill"], ours["steps"]["decode"], ours["wall"]
    gflops = (pre["gflop"] + dec["gflop"]) / wall
    print(f"nanoinfer: {wall:.2f}s | output {num_output / wall:.1f} tok/s | "
          f"total {(num_prompt + num_output) / wall:.1f} tok/s | preemptions {ours['preemptions']}")
    print(f"  prefill {pre['time']:.2f}s in {pre['steps']} steps ({pre['tokens'] / max(pre['time'], 1e-9):.0f} tok/s)"
          f" | decode {dec['time']:.2f}s in {dec['steps']} steps ({dec['sampled'] / max(dec['time'], 1e-9):.1f} tok/s)")
    print(f"  linear GFLOP/s: prefill {pre['gflops']:.1f} ({pre['gflops'] / peak[256]:.0%} of M=256 peak) | "
          f"decode {dec['gflops']:.1f} ({dec['gflops'] / peak[64]:.0%} of M=64 peak) | overall {gflops:.1f} "
          f"({gflops / peak[256]:.0%} of M=256, {gflops / peak[64]:.0%} of M=64 peak)")
    result = dict(model=model, params=num_params, linear_params=linear_params, lm_head_params=head_params,
                  threads=threads, tp=args.tp, args=vars(args), prompt_tokens=num_prompt,
                  output_tokens=num_output, matmul_peak_gflops={"M=64": peak[64], "M=256": peak[256]},
                  f_linear_gflops={"M=64": plain[64], "M=256": plain[256]},
                  nanoinfer=dict(wall_s=wall, output_tok_s=num_output / wall,
                                 total_tok_s=(num_prompt + num_output) / wall, linear_gflops=gflops,
                                 preemptions=ours["preemptions"], prefill=pre, decode=dec))

    if args.profile:
        d = result["decode_profile"] = profile_decode(llm, prompts)
        print(f"decode step at batch {d['batch']} (mean context {d['context']:.0f} tokens), profiled: {d['step_ms']:.1f} "
              f"ms = matmuls {d['matmul_ms']:.1f} + attention {d['attention_ms']:.1f} + other C kernels "
              f"{d['small_ops_ms']:.1f} + rest {d['rest_ms']:.1f} (sampling, inputs, Python, profiler) | "
              f"{d['ratio']:.2f}x its matmuls | unprofiled step (median) {d['plain_step_ms']:.1f} ms, "
              f"{d['plain_step_ms'] / d['matmul_ms']:.2f}x")
    llm.close()  # stops the workers and gives this process its threads back, before transformers runs

    if args.compare_hf:
        bs = args.hf_batch_size or len(prompts)
        hf = run_hf(model, prompts, out_lens, bs, args.hf_static)
        same = sum(a == b for a, b in zip(ours["outputs"], hf["outputs"]))
        print(f"transformers ({hf['cache']} cache, batch {bs}): {hf['wall']:.2f}s | "
              f"output {num_output / hf['wall']:.1f} tok/s | total {(num_prompt + num_output) / hf['wall']:.1f} tok/s"
              f" | identical outputs {same}/{len(prompts)}")
        print(f"  throughput ratio nanoinfer/HF: {hf['wall'] / wall:.2f}x")
        result["hf"] = dict(wall_s=hf["wall"], output_tok_s=num_output / hf["wall"],
                            total_tok_s=(num_prompt + num_output) / hf["wall"], cache=hf["cache"], batch_size=bs,
                            identical_outputs=same, ratio=hf["wall"] / wall)
    if args.ngram:
        spec = result["ngram"] = run_ngram(args, model, prompts, out_lens, ours["outputs"])
        print(f"nanoinfer, n-gram speculation (k={args.ngram}): {spec['wall_s']:.2f}s | output "
              f"{num_output / spec['wall_s']:.1f} tok/s | {wall / spec['wall_s']:.2f}x the plain run | accepted "
              f"{spec['accepted']}/{spec['drafted']} drafts ({spec['acceptance_rate']:.0%}), "
              f"{spec['mean_acceptance_length']:.2f} tokens per drafted step | identical outputs "
              f"{spec['identical_outputs']}/{len(prompts)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def run_ngram(args: argparse.Namespace, model: str, prompts: list[list[int]], out_lens: list[int],
              plain_outputs: list[list[int]]) -> dict:
    """The workload again with n-gram drafts (prompt_lookup 1-4), through generate: wall time, spec-decode
    counters, and how many outputs equal the plain run's."""
    with LLM(model, max_model_len=args.max_input + args.output_len, device="cpu",
             max_num_seqs=args.max_num_seqs or args.num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
             num_kvcache_blocks=args.num_kvcache_blocks, enable_prefix_caching=True, seed=0,
             tensor_parallel_size=args.tp, speculative_config={"method": "ngram", "num_speculative_tokens": args.ngram,
                                                               "prompt_lookup_max": 4, "prompt_lookup_min": 1}) as llm:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
        t0 = time.perf_counter()
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        wall = time.perf_counter() - t0
        stats = llm.llm_engine.spec_decode_stats
    return dict(wall_s=wall, drafted=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length,
                identical_outputs=sum(a == b for a, b in zip(outputs, plain_outputs)))


if __name__ == "__main__":
    main()
