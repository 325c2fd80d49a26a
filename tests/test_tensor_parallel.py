"""Tensor parallelism on CPU (gloo, 2 ranks): greedy tokens equal TP=1's and transformers', seeded samples equal
TP=1's, each rank holds half the weights, a dead worker fails generate fast; via spawned workers and via torchrun
(which embeds too: see test_pooling_tp.py for embed/classify/score with spawned workers)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nanoinfer
from models import ODD_KIND, assert_greedy_match, check_against_hf, hf_greedy, weight_bytes
from nanoinfer import LLM, SamplingParams
from tp_torchrun import GREEDY, MAX_TOKENS, PROMPTS, SEEDED, embeddings

pytestmark = pytest.mark.slow

KINDS = ("qwen3", "qwen2", "llama", ODD_KIND)
LOGIT_ATOL = 1e-4
SCRIPT = Path(__file__).with_name("tp_torchrun.py")
_TP1: dict[str, dict] = {}


def tp1(model_dir: Path) -> dict:
    """The single-process run every TP=2 run must reproduce, and transformers' greedy reference."""
    if model_dir.name not in _TP1:
        with LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256) as llm:
            _TP1[model_dir.name] = dict(
                greedy=[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
                sampled=[o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)],
                embedding=embeddings(llm),
                weight_bytes=weight_bytes(llm.llm_engine.model_runner.model),
                hf=hf_greedy(model_dir, PROMPTS, MAX_TOKENS))
    return _TP1[model_dir.name]


def expected_shard_bytes(model_dir: Path, full_bytes: int) -> float:
    """Half the weights, plus the KV projections a rank repeats when there are fewer KV heads than ranks."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_rows = 2 * head_dim * max(0, 2 - cfg.num_key_value_heads)  # rows replicated instead of split
    kv_bias = 2 * head_dim if cfg.model_type == "qwen2" and cfg.num_key_value_heads < 2 else 0
    per_layer = (kv_rows * cfg.hidden_size + kv_bias) // 2
    return full_bytes / 2 + 4 * cfg.num_hidden_layers * per_layer


@pytest.fixture(scope="module")
def torchrun_launch(model_dir, tmp_path_factory):
    """Started by the first spawn test and left running beside the others: two TP engines on one host at once."""
    out = tmp_path_factory.mktemp("torchrun")
    dirs = [str(model_dir(k)) for k in KINDS]
    root = str(Path(nanoinfer.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(SCRIPT), str(out), *dirs], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    yield proc, out
    if proc.poll() is None:  # the launcher and its ranks: they share the pipe, and its reader waits for them all
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("kind", KINDS)
def test_spawned_tp2_matches_tp1_and_hf(kind, model_dir, torchrun_launch, captured_logits, report_logit_diff):
    d = model_dir(kind)
    ref = tp1(d)
    captured_logits.clear()
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2) as llm:
        assert len(llm.llm_engine.tp.workers) == 1
        greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        sampled = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]
        shard = weight_bytes(llm.llm_engine.model_runner.model)
        worker = llm.llm_engine.tp.workers[0]
    assert worker.returncode == 0 and not dist.is_initialized()  # closed cleanly
    assert [o.outputs[0].token_ids for o in greedy] == ref["greedy"]
    worst = check_against_hf(greedy, ref["hf"], captured_logits)
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"{kind}: max |logit diff| vs transformers {worst:.2e}"
    assert sampled == ref["sampled"]
    assert shard == pytest.approx(expected_shard_bytes(d, ref["weight_bytes"]), rel=0.01)


def test_tp2_prompt_logprobs_in_chunks_match_tp1(qwen3_dir):
    """Rank 0 takes the prompt logprobs' logits a chunk at a time (2 rows here); every rank's LM head must make the
    same gathers, else the step hangs or mixes up rows."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    runs = []
    for tp, budget in ((1, 4096), (2, 32)):
        with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2,
                 max_num_batched_tokens=budget, tensor_parallel_size=tp) as llm:
            assert llm.llm_engine.model_runner.logit_chunk_rows == max(2, budget // 16)
            runs.append(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    for one, two in zip(*runs):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert len(one.prompt_logprobs) == len(two.prompt_logprobs) == len(one.prompt_token_ids)
        for a, b in zip(one.prompt_logprobs[1:] + one.outputs[0].logprobs,
                        two.prompt_logprobs[1:] + two.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_killed_worker_fails_generate_fast(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2)
    worker = llm.llm_engine.tp.workers[0]
    runner = llm.llm_engine.model_runner
    run, steps, killed = runner.launch, [], []

    def run_and_kill(batch):
        steps.append(1)
        if len(steps) == 3:
            os.kill(worker.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return run(batch)

    runner.launch = run_and_kill
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    elapsed = time.monotonic() - killed[0]
    assert elapsed < 30, f"generate took {elapsed:.1f}s to notice the dead worker"
    assert worker.poll() is not None and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_torchrun_launch(model_dir, torchrun_launch):
    proc, out = torchrun_launch
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"torchrun launch did not finish:\n{proc.communicate()[0][-5000:]}")
    ranks = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in ranks), f"torchrun ranks wrote no results:\n{log[-5000:]}"
    results = [json.loads(p.read_text()) for p in ranks]
    for kind in KINDS:
        d = model_dir(kind)
        ref = tp1(d)
        # Every rank returns the same outputs, equal to TP=1's (and so to transformers').
        for rank in results:
            got = rank[d.name]
            assert got["greedy"] == ref["greedy"], kind
            assert got["sampled"] == ref["sampled"], kind
            assert torch.allclose(torch.tensor(got["embedding"]), torch.tensor(ref["embedding"]), atol=1e-4), kind
            assert got["bad_embed"] == "prompt is empty", kind
            assert got["threads"] == 1
        for tokens, hf in zip(ref["greedy"], ref["hf"]):
            assert_greedy_match(tokens, hf["token_ids"], hf["logits"])
        shards = [rank[d.name]["weight_bytes"] for rank in results]
        assert shards[0] == shards[1]
        assert shards[0] == pytest.approx(expected_shard_bytes(d, ref["weight_bytes"]), rel=0.01)
    # Rank 1 killed itself mid-generation: the launch ends (torchrun stops the rest), and rank 0, if it was not
    # stopped first, raised a clear error well within 30 s.
    assert proc.returncode != 0
    assert (out / "kill_time").exists(), log[-5000:]
    if (out / "killed.json").exists():
        killed = json.loads((out / "killed.json").read_text())
        assert "tensor-parallel step failed on rank 0" in killed["error"] and killed["closed"]
        assert killed["raised"] - float((out / "kill_time").read_text()) < 30


def test_gguf_tp2_matches_tp1(tmp_path, monkeypatch):
    """GGUF: every rank dequantizes each tensor and keeps its shard (quantized blocks are not sliced)."""
    from test_gguf import _write_tiny_model

    import nanoinfer.engine.llm_engine as llm_engine
    path = tmp_path / "tiny.gguf"
    _write_tiny_model(path, "llama", tied=True)  # Q8_0 tensors, vocabulary 96, 4 q / 2 kv heads
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # the tiny file has no vocabulary
    prompts = [[5, 6, 7, 8], list(range(9, 40))]
    outputs = []
    for tp in (1, 2):
        with LLM(str(path), device="cpu", dtype="float32", max_model_len=64, tensor_parallel_size=tp) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_the_model_and_its_graphs_go_before_the_process_group(qwen3_dir, monkeypatch):
    """NCCL (2.26 on) destroys a communicator only once every CUDA graph that captured its collectives is gone, and
    waits for ever otherwise: close() drops rank 0's model (decode graphs included) before the process group, and a
    failed step drops the graphs before aborting it."""
    from nanoinfer.engine import parallel
    destroy, seen = parallel.dist.destroy_process_group, []
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2)
    runner = llm.llm_engine.model_runner

    def recording_destroy(*args, **kwargs):
        seen.append((runner.model, runner.graph_runner))
        return destroy(*args, **kwargs)

    monkeypatch.setattr(parallel.dist, "destroy_process_group", recording_destroy)
    llm.close()
    assert seen == [(None, None)]
    llm, seen[:] = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2), []
    runner = llm.llm_engine.model_runner
    runner.graph_runner = "graphs"  # stands in for a CUDA runner's
    os.kill(llm.llm_engine.tp.workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="was killed by SIGKILL"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert seen and all(graphs is None for _, graphs in seen)


def test_spawned_workers_get_their_own_local_rank(qwen3_dir, monkeypatch):
    """A LOCAL_RANK in the caller's environment (a launcher's, a notebook's) must not reach the workers: on CUDA
    each rank's GPU is its LOCAL_RANK, and all would take the same one."""
    from nanoinfer.engine import parallel
    popen, ranks = parallel.subprocess.Popen, []

    def recording_popen(command, *args, **kwargs):
        if parallel._WORKER_COMMAND in command:
            ranks.append((kwargs["env"]["LOCAL_RANK"], kwargs["env"]["LOCAL_WORLD_SIZE"]))
        return popen(command, *args, **kwargs)

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(parallel.subprocess, "Popen", recording_popen)
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0
    assert ranks == [("1", "2")]
