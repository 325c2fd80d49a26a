"""bench.py's code paths at toy size (timings are not checked: speed claims live in its output, not in tests)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cpu_bench_profiles_and_compares_with_transformers(qwen3_dir, tmp_path):
    # --profile decodes 82 more tokens per prompt after the timed run: max_model_len (input + output) must hold them.
    # One thread: toy-sized ops on two threads stall at every OpenMP barrier while other jobs load the cores (3.5
    # minutes seen, against 45 s on one).
    out = tmp_path / "bench.json"
    run_bench("--model", str(qwen3_dir), "--device", "cpu", "--num-seqs", "3", "--min-input", "8",
              "--max-input", "24", "--output-len", "90", "--profile", "--compare-hf", "--threads", "1",
              "--json", str(out))
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 270 and result["nanoinfer"]["wall_s"] > 0
    profile = result["decode_profile"]
    assert profile["batch"] == 3 and profile["matmul_ms"] > 0 and profile["attention_ms"] > 0
    assert result["hf"]["identical_outputs"] == 3


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_bench_code_runs_at_toy_size(device, async_scheduling, tmp_path):
    """Every part of the CUDA benchmark, on the CPU as on a GPU (where a crash would otherwise show only at the end
    of a device call): with async scheduling, or plain with --compare-hf, --profile and --also-async."""
    out = tmp_path / "bench.json"
    proc = run_bench("--dry-run", "--device", device, "--json", str(out),
                     *(["--async-scheduling"] if async_scheduling else ["--compare-hf", "--profile", "--also-async"]))
    assert "nano-vllm workload" in proc.stdout and "output tok/s" in proc.stdout and "Throughput:" in proc.stdout
    assert f"async scheduling {async_scheduling}" in proc.stdout
    result = json.loads(out.read_text())
    assert result["nano_vllm"]["finished"] == 8 and not result["nano_vllm"]["cut_short"]
    if not async_scheduling:
        assert result["nano_vllm_async"]["finished"] == 8 and result["greedy"]["ratio"] > 0
        assert result["decode_profile"] is not None, proc.stdout[-2000:]


def test_cuda_greedy_comparison_misses_the_prefix_cache(monkeypatch):
    """--compare-hf's greedy prompts share no first KV block with the benchmark's, which the engine's prefix cache
    still holds when they run (transformers has no such cache)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bench
    work = bench.GPUWorkload()
    runs = bench.nano_vllm_workload(work.num_seqs, work.max_input_len, work.max_output_len)[0]
    first_blocks = {tuple(p[:16]) for p in runs}
    assert not any(tuple(p[:16]) in first_blocks for p in bench.greedy_prompts(work))


def test_sampler_benchmark_runs_at_toy_size_on_cpu():
    """benchmarks/sampler.py, which times the CUDA race kernel on a GPU, runs its cases on the CPU too."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampler.py"), "--device", "cpu", "--batch", "4",
                           "--vocab", "1000", "--iters", "1"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| Sampler") or line.startswith("| vLLM")]
    assert len(rows) == 6 and all(float(row.split("|")[2]) > 0 for row in rows), proc.stdout
