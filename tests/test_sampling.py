"""Sampling: the Sampler on hand-made logits (filters, greedy rows, goodness of fit), counter-based noise and
sampling where the logits are (no host copy of [rows, vocab], no host sync), penalty counts kept on the device,
per-request seeds through the engine, incremental detokenization, and SamplingParams validation."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from transformers import AutoTokenizer, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

from models import hf_forward_logits, load_hf_model, random_prompts
from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.sampling_state import HostStaging, PenaltyCache, TokenTables, bad_word_bans
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers import sampler as sampler_module
from nanoinfer.layers.sampler import Sampler, SamplingMetadata, exponential_noise, noise_keys
from nanoinfer.sampling_params import bad_words_token_ids
from nanoinfer.utils import default_model
from nanoinfer.utils.gguf_loader import load_gguf_tokenizer

ROOT = Path(__file__).resolve().parent.parent

# Chi-square critical values at the 0.999 quantile (scipy.stats.chi2.ppf(0.999, df)); scipy is not installed.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def keys(seeds, positions) -> torch.Tensor:
    return torch.from_numpy(noise_keys(np.array(seeds, dtype=np.uint64), np.array(positions, dtype=np.uint64)))


def sample(logits, temperature, top_k=-1, top_p=1.0, seeds=None, seed=0, positions=None):
    """One call of the Sampler; scalars are broadcast over the rows. Rows without a seed of their own draw one
    from `seed`, as the engine does for unseeded requests."""
    b = logits.shape[0]

    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * b, dtype=dtype)

    rng = random.Random(seed)
    seeds = [s if s is not None else rng.getrandbits(64) for s in (seeds or [None] * b)]
    temperatures = col(temperature, torch.float32)
    return Sampler()(logits.float(), SamplingMetadata(
        temperatures=temperatures, top_k=col(top_k, torch.int64), top_p=col(top_p, torch.float32),
        noise_keys=keys(seeds, positions or [0] * b), all_greedy=bool((temperatures == 0).all()))).token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def top_p_set(probs: torch.Tensor, p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches p (computed independently of the Sampler)."""
    values, order = probs.sort(descending=True)
    kept, mass = [], 0.0
    for v, i in zip(values.tolist(), order.tolist()):
        kept.append(i)
        mass += v
        if mass >= p:
            break
    return set(kept)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference distribution: softmax(logits / T), keep the top k, renormalise, keep the top-p set, renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    if 0 < top_k < len(probs):
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[probs.topk(top_k).indices] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    kept = top_p_set(probs, top_p)
    probs = torch.tensor([float(probs[i]) if i in kept else 0.0 for i in range(len(probs))], dtype=torch.float64)
    return probs / probs.sum()


# ----------------------------------------------------------------------------------------------------------
# Sampler unit tests
# ----------------------------------------------------------------------------------------------------------

def test_top_k_never_emits_tokens_outside_the_k_largest_and_reaches_all_of_them():
    g = torch.Generator().manual_seed(1)
    vocab = 40
    base = torch.randn(3, vocab, generator=g) * 0.7  # distinct values; temperature 1 keeps the top ones likely
    ks = [1, 3, 10]
    reps = 700
    logits = base.repeat_interleave(reps, 0)  # rows 0..699 are row 0, ...
    tokens = sample(logits, 1.0, top_k=[k for k in ks for _ in range(reps)], seed=3).view(3, reps)
    for row, k in enumerate(ks):
        allowed = set(base[row].topk(k).indices.tolist())
        emitted = set(tokens[row].tolist())
        assert emitted <= allowed, f"top_k={k}: emitted {sorted(emitted - allowed)} outside the top {k}"
        # Every allowed token has renormalised probability > 1.5% here, so 700 draws hit all of them.
        probs = torch.softmax(base[row][sorted(allowed)], -1)
        assert float(probs.min()) > 0.015
        assert emitted == allowed, f"top_k={k}: never emitted {sorted(allowed - emitted)}"


def test_top_k_keeps_every_token_tied_with_the_kth_largest_as_transformers():
    """The cut is by value, as transformers' TopKLogitsWarper and vLLM cut: bf16 logits (the LM head's on a GPU) tie
    often, and a cut by rank kept whichever tied token the device's sort put first."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 4096, generator=g) * 3).bfloat16().float()
    ks = [1, 20, 50, 300]
    ranked = logits.sort(-1, descending=True).values
    assert [bool(row[k - 1] == row[k]) for row, k in zip(ranked, ks)] == [False, False, True, True]  # ties at the cut
    for top_p in (None, torch.ones(4)):
        warped = Sampler.warp(logits, SamplingMetadata(temperatures=torch.ones(4), top_k=torch.tensor(ks),
                                                       top_p=top_p, all_greedy=False))
        for row, k in enumerate(ks):
            kept = TopKLogitsWarper(k)(None, logits[row:row + 1])[0].isfinite()
            assert torch.equal(warped[row].isfinite(), kept), f"top_k={k}, top_p={top_p}"


@pytest.mark.parametrize("top_p", [None, [1.0, 0.5, 0.9, 1.0, 0.3]], ids=["top-k", "top-k-and-top-p"])
def test_top_k_and_top_p_from_one_topk_cut_as_the_sort_does(top_p):
    """Where no row has top-p without top-k, the cuts take one topk of the most any row keeps instead of sorting the
    vocabulary: the same logits (bf16 values, which tie), rows that disable top-k (0, the vocabulary size) and
    top-p (1) untouched, each row's top-p set that of its top-k survivors, extended to the tokens tied with its
    smallest."""
    logits = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(6)) * 3).bfloat16().float()
    ks = torch.tensor([0, 1, 37, 1000, 250])

    def warp(max_top_k):
        return Sampler.warp(logits, SamplingMetadata(temperatures=torch.ones(5), top_k=ks, all_greedy=False,
                                                     top_p=None if top_p is None else torch.tensor(top_p),
                                                     max_top_k=max_top_k))
    by_sort = warp(None)
    assert torch.equal(warp(250), by_sort)
    kept = by_sort.isfinite().sum(-1).tolist()
    assert kept[0] == kept[3] == 1000 and kept[1] == 1
    if top_p is None:
        assert 37 <= kept[2] < 50 and 250 <= kept[4] < 270
        return
    for row in (2, 4):
        x = logits[row].double()
        x = torch.where(x >= x.topk(int(ks[row])).values[-1], x, float("-inf"))
        smallest = min(x[i] for i in top_p_set(x.softmax(-1), top_p[row]))
        assert torch.equal(by_sort[row].isfinite(), x >= smallest), row
    assert 1 < kept[2] < 37 and 1 < kept[4] < 250


@pytest.mark.parametrize("top_k, max_top_k", [(None, None), (4, None), (4, 4)])
def test_top_p_keeps_every_token_tied_with_the_last_one_kept(top_k, max_top_k):
    """The top-p cut is by value too: p(3.0) = 0.66 (0.71 among the top 4) < 0.75, so a 1.0 token joins, and so
    do the two it ties with, whichever of them a sort would have ranked first."""
    logits = torch.tensor([[3.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    warped = Sampler.warp(logits, SamplingMetadata(
        temperatures=torch.ones(1), top_k=None if top_k is None else torch.tensor([top_k]),
        top_p=torch.tensor([0.75]), all_greedy=False, max_top_k=max_top_k))
    assert warped[0].isfinite().tolist() == [True, True, False, True, False, True]


@pytest.mark.parametrize("top_k, max_top_k", [(None, None), (4, None), (4, 4)])
def test_a_row_with_every_token_masked_leaves_the_top_p_cut_of_the_others_alone(top_k, max_top_k):
    """A row whose every logit is -inf (its only allowed tokens withheld) has no top-p set; its cut must not index
    the ranked values at -1 for every row (on CUDA, a device assert that ends the process's context)."""
    logits = torch.tensor([[3.0, 1.0, 0.0, 1.0, 0.0, 1.0], [float("-inf")] * 6, [0.0, 5.0, 0.0, 0.0, 0.0, 0.0]])
    warped = Sampler.warp(logits, SamplingMetadata(
        temperatures=torch.ones(3), top_k=None if top_k is None else torch.tensor([top_k] * 3),
        top_p=torch.tensor([0.75, 0.5, 1.0]), all_greedy=False, max_top_k=max_top_k))
    assert warped.isfinite().tolist() == [[True, True, False, True, False, True], [False] * 6,
                                          [True] * 6]


@pytest.mark.parametrize("spread, widths", [(4.0, [1024]), (0.01, [1024, 4096])], ids=["peaked", "flat"])
def test_top_p_alone_on_the_cpu_ranks_only_the_logits_its_sets_need(spread, widths, monkeypatch):
    """On the CPU, top-p without top-k ranks 1,024 logits, then 4x as many while a row's set reaches the last one,
    before it sorts the vocabulary: the same cut as the sort's (5,000 bf16 logits, sets of a few tokens to nearly
    all, ties), from a topk of 1,024 for the peaked rows, from the sort for the flat ones."""
    logits = (torch.randn(4, 5000, generator=torch.Generator().manual_seed(8)) * spread).bfloat16().float()
    top_p = [0.3, 0.9, 0.99, 1.0]
    ranked = []
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda x, k, *args: ranked.append(k) or topk(x, k, *args))
    warped = Sampler.warp(logits, SamplingMetadata(temperatures=torch.ones(4), top_k=None, top_p=torch.tensor(top_p),
                                                   all_greedy=False))
    assert ranked == widths
    for row, p in enumerate(top_p):
        x = logits[row].double()
        smallest = min(x[i] for i in top_p_set(x.softmax(-1), p)) if p < 1 else x.min()
        assert torch.equal(warped[row].isfinite(), x >= smallest), row
    kept = warped.isfinite().sum(-1).tolist()
    assert kept[0] < kept[1] < kept[2] < kept[3] == 5000 and (kept[2] < 1024) == (spread > 1), kept


def test_top_p_never_emits_tokens_outside_the_smallest_set_reaching_p():
    g = torch.Generator().manual_seed(2)
    vocab = 30
    temperature = 0.8
    base = torch.randn(3, vocab, generator=g) * 0.6
    ps = [0.3, 0.55, 0.8]  # top-p sets of 3, 7 and 16 tokens
    reps = 800
    tokens = sample(base.repeat_interleave(reps, 0), temperature, top_p=[p for p in ps for _ in range(reps)],
                    seed=4).view(3, reps)
    for row, p in enumerate(ps):
        probs = torch.softmax(base[row].double() / temperature, -1)
        cumulative = probs.sort(descending=True).values.cumsum(0)
        assert float((cumulative - p).abs().min()) > 5e-3, "p too close to a cumulative boundary for this test"
        allowed = top_p_set(probs, p)
        assert 1 < len(allowed) < vocab
        emitted = set(tokens[row].tolist())
        assert emitted <= allowed, f"top_p={p}: emitted {sorted(emitted - allowed)} outside {sorted(allowed)}"
        renormalised = probs[sorted(allowed)] / probs[sorted(allowed)].sum()
        assert float(renormalised.min()) > 0.02  # so 800 draws reach every allowed token
        assert emitted == allowed, f"top_p={p}: never emitted {sorted(allowed - emitted)}"


def test_temperature_zero_rows_are_argmax_in_a_mixed_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 0.5]
    top_k = [-1, -1, 5, -1, -1, 3]
    top_p = [1.0, 0.9, 1.0, 1.0, 0.2, 1.0]
    greedy_rows = [i for i, t in enumerate(temps) if t == 0]
    sampled_rows = [i for i, t in enumerate(temps) if t > 0]
    argmax = logits.argmax(-1)
    seen_non_argmax = False
    for seed in range(40):
        seeds = [100 + seed if i % 2 else None for i in range(6)]
        out = sample(logits, temps, top_k=top_k, top_p=top_p, seeds=seeds, seed=seed)
        assert out[greedy_rows].tolist() == argmax[greedy_rows].tolist()
        seen_non_argmax |= bool((out[sampled_rows] != argmax[sampled_rows]).any())
    assert seen_non_argmax, "the sampled rows never left the argmax: they were not sampled"


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(6))
    assert sample(logits, 0.0).tolist() == logits.argmax(-1).tolist()


LOGITS6 = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5])


@pytest.mark.parametrize("keying", ["engine-seed", "consecutive-seeds", "consecutive-positions"])
def test_temperature_chi_square_goodness_of_fit(keying):
    """Rows keyed by seeds drawn from the engine's seed, by seeds 0..n-1 at one position, or by one seed at
    positions 0..n-1 (a long sequence's successive tokens): all must follow softmax(logits / T)."""
    n, temperature = 20_000, 0.7
    expected = torch.softmax(LOGITS6.double() / temperature, -1)
    seeds = {"engine-seed": None, "consecutive-seeds": list(range(n)), "consecutive-positions": [7] * n}[keying]
    positions = list(range(n)) if keying == "consecutive-positions" else None
    tokens = sample(LOGITS6.expand(n, -1).contiguous(), temperature, seeds=seeds, seed=11, positions=positions)
    counts = torch.bincount(tokens, minlength=6).double()
    stat = chi_square(counts, expected)
    assert stat < CHI2_999[5], f"chi2={stat:.1f} (df=5); counts={counts.tolist()} expected={(expected * n).tolist()}"
    # The test has power: the same counts are far from the distribution at a wrong temperature.
    wrong = torch.softmax(LOGITS6.double() / 1.0, -1)
    assert chi_square(counts, wrong) > 10 * CHI2_999[5]


def test_top_k_top_p_combined_renormalised_chi_square():
    n, temperature, top_k, top_p = 20_000, 0.7, 4, 0.85
    expected = filtered_probs(LOGITS6, temperature, top_k, top_p)
    kept = [i for i in range(6) if expected[i] > 0]
    assert kept == [0, 1, 2]  # top 4 renormalised: .536 .262 .128 .073 -> the top-p set is 3 tokens
    tokens = sample(LOGITS6.expand(n, -1).contiguous(), temperature, top_k=top_k, top_p=top_p, seed=12)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[3:].sum() == 0, f"filtered tokens were emitted: {counts.tolist()}"
    stat = chi_square(counts[kept], expected[kept])
    assert stat < CHI2_999[len(kept) - 1], f"chi2={stat:.1f}; counts={counts.tolist()} expected={expected * n}"
    # Power: the same filters at temperature 1 keep the same tokens but in clearly different proportions.
    wrong = filtered_probs(LOGITS6, 1.0, top_k, top_p)
    assert [i for i in range(6) if wrong[i] > 0] == kept
    assert chi_square(counts[kept], wrong[kept]) > 10 * CHI2_999[len(kept) - 1]


# ----------------------------------------------------------------------------------------------------------
# Counter-based noise and sampling where the logits are
# ----------------------------------------------------------------------------------------------------------

def test_noise_depends_only_on_seed_position_and_token():
    vocab = 1000
    k = keys([5, 5, 6, 2**64 - 1], [10, 11, 10, 10])
    batch = exponential_noise(k, vocab)
    assert batch.shape == (4, vocab) and batch.dtype == torch.float32
    # A row's noise is the same in any batch, alone or elsewhere; a different seed or position changes it.
    assert torch.equal(exponential_noise(k[[2, 0]], vocab), batch[[2, 0]])
    assert torch.equal(exponential_noise(k[1:2], vocab + 7)[:, :vocab], batch[1:2])
    for a, b in [(0, 1), (0, 2), (0, 3)]:
        assert (batch[a] != batch[b]).float().mean() > 0.99
    # Exp(1): the fractions below quantiles match 1 - exp(-x) within 1% over 4,000 draws, and nothing is 0 or inf.
    assert bool(torch.isfinite(batch).all()) and float(batch.min()) > 0
    for x in (0.1, 0.5, 1.0, 2.0, 4.0):
        assert abs(float((batch < x).float().mean()) - (1 - math.exp(-x))) < 0.025
    # Consecutive seeds and positions give uncorrelated rows.
    rows = exponential_noise(keys(list(range(64)), [0] * 64), vocab)
    corr = torch.corrcoef(rows)
    assert float((corr - torch.eye(64)).abs().max()) < 0.2


RACE_KERNEL_CHECK = """
import sys; sys.path.insert(0, "tests")
import numpy as np, torch
import gpu_like_memory  # tests/gpu_like_memory.py: loads and stores in bounds, empty memory NaN
gpu_like_memory.check_memory_bounds()
gpu_like_memory.poison_empty()
from nanoinfer.kernels.triton_sampling import BLOCK, gumbel_max
from nanoinfer.layers.sampler import exponential_noise, exponential_race, noise_keys
g = torch.Generator().manual_seed(0)
rows = 24
k = torch.from_numpy(noise_keys(np.arange(rows, dtype=np.uint64) * 977 + 2**63, np.arange(rows, dtype=np.uint64)))
t = torch.rand(rows, generator=g) * 1.5 + 0.2
t[0] = 0.0  # a greedy row's temperature, clamped to 1e-6 as Sampler.warp clamps it
for vocab in (1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 300):
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[1, 1:] = float("-inf")  # one token left (top-k 1): it is drawn
    logits[2, ::2] = float("-inf")  # filtered tokens are never drawn
    ours = gumbel_max(logits, t, k)
    scaled = logits / t.clamp_min(1e-6).unsqueeze(1)
    # Scaling here or in the kernel gives the same floats, so the same tokens (Sampler.draw takes either path).
    assert torch.equal(ours, gumbel_max(scaled, None, k)), vocab
    # The race in logs draws what the CPU's race draws: argmax p / E, the same noise.
    assert ours.tolist() == exponential_race(torch.softmax(scaled, -1), k).tolist(), vocab
    assert ours[1] == 0 and (vocab == 1 or ours[2] % 2 == 1)
    # And it is the race computed in float64 (no row here has a near-tie that rounding could turn).
    score = (scaled.double() - exponential_noise(k, vocab).double().log()).nan_to_num(float("-inf"))
    assert torch.equal(ours, score.argmax(-1)), vocab
# Its tiles are per row: a row's token is the same alone as in the batch.
assert gumbel_max(logits[5:6], t[5:6], k[5:6]).item() == ours[5].item()
# Logits that dwarf the noise tie exactly in fp32: the first index wins, across tiles and within one, as in argmax.
tie = torch.zeros(2, 2 * BLOCK)
tie[0, [5, BLOCK + 1]] = tie[1, [40, 9]] = 1e30
assert gumbel_max(tie, None, k[:2]).tolist() == [5, 9]
print("race kernel ok")
"""


@pytest.mark.slow
def test_triton_race_kernel_draws_what_the_cpu_race_draws_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    r = subprocess.run([sys.executable, "-c", RACE_KERNEL_CHECK], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0 and "race kernel ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_and_seeded_tokens_are_the_same_on_cuda_and_cpu():
    k = keys([0, 3, 2**63], [1, 2, 3])
    torch.testing.assert_close(exponential_noise(k.cuda(), 151_936).cpu(), exponential_noise(k, 151_936),
                               rtol=1e-5, atol=0)
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(9))
    args = dict(temperature=[0.7, 1.0, 1.3], top_k=[-1, 40, -1], top_p=[1.0, 1.0, 0.9], seeds=[0, 3, 2**63],
                positions=[1, 2, 3])
    on_cuda = Sampler()(logits.cuda(), SamplingMetadata(
        temperatures=torch.tensor(args["temperature"]).cuda(), top_k=torch.tensor(args["top_k"]).cuda(),
        top_p=torch.tensor(args["top_p"]).cuda(), noise_keys=k.cuda(), all_greedy=False)).token_ids
    assert on_cuda.device.type == "cuda" and on_cuda.tolist() == sample(logits, **args).tolist()
    # Temperature alone: the race kernel scales the logits itself (top_k and top_p None), with a greedy row.
    temperatures = torch.tensor([0.7, 0.0, 1.3])
    on_cuda = Sampler()(logits.cuda(), SamplingMetadata(temperatures=temperatures.cuda(), top_k=None, top_p=None,
                                                        noise_keys=k.cuda(), all_greedy=False)).token_ids
    on_cpu = Sampler()(logits, SamplingMetadata(temperatures=temperatures, top_k=None, top_p=None, noise_keys=k,
                                                all_greedy=False)).token_ids
    assert on_cuda.tolist() == on_cpu.tolist() and on_cpu[1] == logits[1].argmax()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_host_copy_per_step_on_cuda(qwen3_dir, monkeypatch):
    """Token ids, logprobs and prompt logprobs of a step come back in a single device-to-host copy."""
    # Closed on failure too (num_kvcache_blocks: no 90% of the GPU held meanwhile): later tests need its memory.
    with LLM(str(qwen3_dir), max_model_len=MAX_LEN, device="cuda", dtype="float32", enforce_eager=True,
             num_kvcache_blocks=64) as llm:
        runner = llm.llm_engine.model_runner
        copies, steps = [0], [0]
        copy_, run = torch.Tensor.copy_, ModelRunner.launch

        def counting_copy(dst, src, *args, **kwargs):
            copies[0] += dst.device.type == "cpu" and src.device.type == "cuda"
            return copy_(dst, src, *args, **kwargs)

        def counting_run(self, batch):
            steps[0] += 1
            return run(self, batch)

        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
        monkeypatch.setattr(ModelRunner, "launch", counting_run)
        big = HostCopies(monkeypatch, llm.llm_engine.vocab_size, "cuda")
        params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, logprobs=2, prompt_logprobs=1,
                                max_tokens=6, ignore_eos=True, seed=0)
        outs = llm.generate(random_prompts(3, 5, 400, 5, 9, seed=44), params, use_tqdm=False)
        assert all(len(o.outputs[0].logprobs) == 6 and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
        assert all(buffer.is_pinned() for buffer in runner.to_host.buffers)
        assert copies[0] == steps[0] and big.seen == []


def test_sampled_tokens_of_a_row_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 300, generator=g) * 2
    seeds, positions = [11, 12, 13, 14, 15], [3, 40, 7, 7, 100]
    args = dict(temperature=[0.9, 1.3, 0.0, 0.7, 1.0], top_k=[-1, 50, -1, 10, -1], top_p=[1.0, 0.9, 1.0, 0.95, 0.8])
    full = sample(logits, seeds=seeds, positions=positions, **args)
    for rows in ([3], [4, 0], [1, 3, 2]):
        sub = sample(logits[rows], seeds=[seeds[r] for r in rows], positions=[positions[r] for r in rows],
                     **{k: [v[r] for r in rows] for k, v in args.items()})
        assert sub.tolist() == full[rows].tolist()


def test_all_greedy_batch_draws_no_noise(monkeypatch):
    monkeypatch.setattr(sampler_module, "exponential_noise", lambda *a: pytest.fail("noise drawn for greedy rows"))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    assert sample(logits, 0.0).tolist() == logits.argmax(-1).tolist()


def meta_runner() -> ModelRunner:
    """The sampling half of a ModelRunner on the meta device, where any host synchronisation (.item(), .tolist(),
    bool() of a tensor, a copy to the CPU) raises: what passes here never waits for the device."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("meta")
    runner.sampler, runner.seeds = Sampler(), random.Random(0)
    runner.input_batch, runner.upload = InputBatch(4, 16, 32, 4, runner.device), HostStaging(runner.device)
    runner.penalty_cache, runner.token_tables = PenaltyCache(runner.upload), TokenTables(4, runner.upload)
    runner.logits_processors, runner.config = None, SimpleNamespace(logprobs_mode="raw_logprobs")
    return runner


def prepare_decode(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """The runner's prepare() of a step decoding the last token of each of seqs: their rows and sampled rows."""
    for seq in seqs:
        seq.num_computed_tokens, seq.block_table = len(seq) - 1, list(range(seq.num_blocks))
    batch = ScheduledBatch(seqs, [1] * len(seqs))
    runner.input_batch.prepare(batch, batch.samples)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_sampling_with_every_feature_never_synchronises_with_the_device(logprobs_mode):
    vocab = 97
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2, logit_bias={3: 1.5, 9: -2.0}),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3, min_tokens=4,
                             stop_token_ids=[7], allowed_token_ids=[1, 4, 7, 8]),
              SamplingParams(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.3, logprobs=0,
                             logit_bias={5: 1.0}, allowed_token_ids=[4, 5]),
              SamplingParams(temperature=0.0)]
    words = ((4,), (4, 6))
    seqs = [Sequence([1, 2, 3, 2], p, 4, eos_token_ids=frozenset({0}), bad_words_token_ids=words * (i < 2))
            for i, p in enumerate(params)]
    seqs[2].token_ids += [5, 5, 9]
    runner = meta_runner()
    runner.config.logprobs_mode = logprobs_mode
    for _ in range(2):
        prepare_decode(runner, seqs)
        out = runner.sample(seqs, torch.empty(4, vocab, device="meta"))
        assert out.token_ids.device.type == "meta" and out.token_ids.shape == (4,)
        assert all(t.device.type == "meta" for t in out.logprobs) and out.logprobs[2].shape == (4, 2)
        for seq in seqs:
            seq.token_ids.append(4)
    prepare_decode(runner, seqs)
    m = runner._sampling_metadata(seqs, vocab)
    assert m.penalties.output_counts.device.type == "meta" and m.noise_keys.device.type == "meta"
    assert m.disallowed[1].shape == (2, vocab) and m.logit_bias[1].shape == (2, 2)
    assert m.banned[0].numel() == 6  # rows 0 and 1: tokens 4 and 6 (bad words); row 1: 0 and 7 (min_tokens)


class HostCopies:
    """Records every copy to the host (cpu(), tolist(), numpy(), item(), to("cpu")) of a tensor on `device_type`
    of at least `size` elements."""

    def __init__(self, monkeypatch, size: int, device_type: str):
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        for name in ("cpu", "tolist", "numpy", "item", "to"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._recording(name, original, size, device_type))

    def _recording(self, name, original, size, device_type):
        def method(t, *args, **kwargs):
            to_cpu = name != "to" or any(str(a) == "cpu" for a in (*args, *kwargs.values()))
            if to_cpu and t.numel() >= size and t.device.type == device_type:
                self.seen.append((name, tuple(t.shape)))
            return original(t, *args, **kwargs)
        return method


def test_logits_stay_where_they_are_computed(llm, monkeypatch):
    """No [rows, vocab] tensor is copied to the host, whatever the request asks for; only ids and the requested
    logprobs are (on the CPU the device is the host, so this counts the calls that would copy)."""
    vocab = llm.llm_engine.vocab_size
    prompts = random_prompts(3, 5, 60, 6, 12, seed=41)
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.2, min_tokens=2, max_tokens=5, seed=1),
              SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)]
    copies = HostCopies(monkeypatch, vocab, "cpu")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(c.token_ids) for c in outs[0].outputs + outs[2].outputs] == [5, 5] and len(outs[1].outputs) == 2
    assert len(outs[0].outputs[0].logprobs) == 5 and len(outs[0].prompt_logprobs) == len(prompts[0])
    assert copies.seen == [], f"[rows, vocab] tensors copied to the host: {copies.seen}"


# ----------------------------------------------------------------------------------------------------------
# Penalty counts on the device
# ----------------------------------------------------------------------------------------------------------

def test_penalty_counts_follow_the_tokens_across_preemption_and_n(llama_dir, monkeypatch):
    """Each step the cache's rows equal the prompt mask and output counts rebuilt from the token ids, through
    preemption (recompute) and slot reuse, and a sequence's slot is filled once, not every step."""
    checked, claims = [0], []
    gather, claim = PenaltyCache.gather, PenaltyCache._claim

    def checking_gather(self, seqs, vocab):
        mask, counts = gather(self, seqs, vocab)
        for seq, m, c in zip(seqs, mask, counts):
            ref_mask = torch.zeros(vocab, dtype=torch.bool)
            ref_mask[seq.token_ids[:seq.num_prompt_tokens]] = True
            ref_counts = torch.bincount(torch.tensor(seq.completion_token_ids, dtype=torch.long), minlength=vocab)
            assert torch.equal(m, ref_mask) and torch.equal(c, ref_counts.float())
            checked[0] += 1
        return mask, counts

    def counting_claim(self, seq, vocab):
        claims.append(seq.seq_id)
        return claim(self, seq, vocab)

    monkeypatch.setattr(PenaltyCache, "gather", checking_gather)
    monkeypatch.setattr(PenaltyCache, "_claim", counting_claim)
    llm = LLM(str(llama_dir), max_model_len=96, num_kvcache_blocks=12, max_num_batched_tokens=24,
              kvcache_block_size=8, max_num_seqs=6, device="cpu")
    prompts = random_prompts(12, 5, 30, 10, 40, seed=42)  # a narrow id range: repeats in prompt and output
    params = SamplingParams(n=2, temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.4, max_tokens=20,
                            ignore_eos=True, seed=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(c.token_ids) == 20 for o in outs for c in o.outputs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    cache = llm.llm_engine.model_runner.penalty_cache
    assert checked[0] >= 24 * 20 and len(cache.owners) <= 8  # slots of finished sequences are reused
    # Once per sequence, plus once per readmission after its slot went to another sequence while it waited.
    assert len(set(claims)) == 24 and len(claims) < 24 + llm.llm_engine.scheduler.num_preemptions + 1


# ----------------------------------------------------------------------------------------------------------
# Engine-level seeds
# ----------------------------------------------------------------------------------------------------------

MAX_LEN = 96


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN, seed=0, kvcache_block_size=8)


def tokens_of(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_request_is_independent_of_the_batch(llm):
    prompts = random_prompts(5, 5, 448, 3, 20, seed=21)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens_of(llm, [prompts[0]], seeded)[0]
    assert len(alone) == 16
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 20, 9)]
    others.append(SamplingParams(temperature=0.8, seed=99, top_k=50, max_tokens=12, ignore_eos=True))
    first = tokens_of(llm, prompts, [seeded] + others)
    last = tokens_of(llm, prompts[1:] + prompts[:1], others + [seeded])
    assert first[0] == alone
    assert last[-1] == alone
    # The same seeded request twice in one batch (the second one shares the first one's cached prefix).
    twice = tokens_of(llm, [prompts[0], prompts[2], prompts[0]], [seeded, others[0], seeded])
    assert twice[0] == alone and twice[2] == alone


def test_different_seeds_give_different_outputs(llm):
    prompt = random_prompts(1, 5, 448, 10, 10, seed=22)[0]
    outs = tokens_of(llm, [prompt] * 3, [SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True)
                                         for s in (1, 2, 1)])
    assert outs[0] == outs[2]
    assert outs[0] != outs[1]
    assert sum(a != b for a, b in zip(outs[0], outs[1])) >= 8  # temperature 1.5: nearly every token differs


def test_unseeded_requests_reproducible_across_fresh_engines_with_the_same_seed(qwen3_dir):
    prompts = random_prompts(3, 5, 448, 4, 12, seed=23)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)

    def run(seed):
        return tokens_of(LLM(str(qwen3_dir), device="cpu", dtype="float32",
                             max_model_len=MAX_LEN, seed=seed), prompts, params)

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # different prompts, not a constant output


@pytest.mark.parametrize("top_k", [2**70, 0], ids=["beyond-int64", "zero"])
def test_top_k_beyond_int64_or_zero_beside_a_real_top_k_filters_nothing(llm, top_k):
    """A row's top_k is kept in an int64 array: one past its range is as good as the vocabulary, even when another
    row's top_k makes the step filter; 0 disables it as -1 does (vLLM's default is 0, and it takes -1 too)."""
    prompts = random_prompts(2, 5, 448, 3, 9, seed=25)
    unfiltered, plain = (SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=8, ignore_eos=True)
                         for k in (top_k, -1))
    other = SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=8, ignore_eos=True)
    assert tokens_of(llm, prompts, [unfiltered, other])[0] == tokens_of(llm, prompts[:1], plain)[0]


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    prompts = random_prompts(4, 5, 448, 2, 15, seed=24)
    greedy = tokens_of(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    top1 = tokens_of(llm, prompts, SamplingParams(temperature=1.3, top_k=1, seed=5, max_tokens=12, ignore_eos=True))
    tiny_p = tokens_of(llm, prompts, SamplingParams(temperature=1.3, top_p=1e-6, max_tokens=12, ignore_eos=True))
    sampled = tokens_of(llm, prompts, SamplingParams(temperature=1.3, seed=5, max_tokens=12, ignore_eos=True))
    assert top1 == greedy
    assert tiny_p == greedy
    assert sampled != greedy  # the same settings without the filter do sample


# ----------------------------------------------------------------------------------------------------------
# SamplingParams validation
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature="1.0"), TypeError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=-0.1), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=None), TypeError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=-3), ValueError, "max_tokens"),
    (dict(max_tokens=4.0), TypeError, "max_tokens"),
    (dict(max_tokens="8"), TypeError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed="0"), TypeError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=-2**63 - 1), ValueError, "seed"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[1, "2"]), TypeError, "stop_token_ids"),
    (dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias must be a dict.*got list"),
    (dict(logit_bias={"5": 1.0}), TypeError, "logit_bias token ids must be ints, got '5'"),
    (dict(logit_bias={5: "1"}), TypeError, r"logit_bias\[5\] must be a number"),
    (dict(logit_bias={5: float("inf")}), ValueError, r"logit_bias\[5\] must be finite, got inf"),
    (dict(logit_bias={5: float("nan")}), ValueError, r"logit_bias\[5\] must be finite, got nan"),
    (dict(logit_bias={-1: 1.0}), ValueError, "logit_bias token ids must be >= 0, got -1"),
    (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=5), TypeError, "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 2.0]), TypeError, "allowed_token_ids.*2.0"),
    (dict(allowed_token_ids=[1, -3]), ValueError, "allowed_token_ids token ids must be >= 0, got -3"),
    (dict(bad_words="word"), TypeError, "bad_words"),
    (dict(bad_words=["a", 3]), TypeError, "bad_words.*3"),
    (dict(bad_words=["a", " "]), ValueError, "bad_words.*' '"),
    (dict(truncate_prompt_tokens=0), ValueError, "truncate_prompt_tokens.*got 0"),
    (dict(truncate_prompt_tokens=-2), ValueError, "truncate_prompt_tokens.*got -2"),
    (dict(truncate_prompt_tokens=1.5), TypeError, "truncate_prompt_tokens.*1.5"),
])
def test_sampling_params_validation(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edge_values():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(top_p=1.0).top_p == 1.0
    assert SamplingParams(top_k=-1, max_tokens=1, seed=0).max_tokens == 1
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    for seed in (-2**63, -1, 2**64 - 1):  # the whole range torch.Generator.manual_seed accepts
        SamplingParams(seed=seed)
    assert math.isclose(SamplingParams(top_p=1e-9).top_p, 1e-9)


# ----------------------------------------------------------------------------------------------------------
# Incremental detokenization
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(qwen3_dir):
    """The test models' byte-level BPE tokenizer, and SmolLM2's (a real 49,152-token vocabulary) when cached."""
    toks = {"test": AutoTokenizer.from_pretrained(qwen3_dir)}
    try:
        toks["smollm2"] = load_gguf_tokenizer(default_model.default_model_path())
    except (RuntimeError, ImportError):
        pass  # not downloadable here, or no gguf package to read it (then no download is tried); the test one runs
    return toks


def random_completion(tok, rng: random.Random) -> list[int]:
    """Random ids (mostly lone bytes and fragments of multi-byte characters for a byte-level vocabulary) with
    special tokens and a run of real multi-byte text."""
    text = tok.encode(rng.choice(["héllo wörld", "€ 😀 日本語", "naïve café ✓", "Ω≈ç√∫"]), add_special_tokens=False)
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
    ids[rng.randint(0, len(ids)):0] = text
    for _ in range(rng.randint(0, 3)):
        ids.insert(rng.randint(0, len(ids)), rng.choice(tok.all_special_ids))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization_equals_decoding_the_whole_completion(tokenizers, skip_special_tokens):
    for name, tok in tokenizers.items():
        rng = random.Random(43)
        held_back = 0
        for _ in range(200):
            ids = random_completion(tok, rng)
            detok = IncrementalDetokenizer(skip_special_tokens)
            for j in range(1, len(ids) + 1):
                text = detok.update(tok, ids[:j])
                whole = tok.decode(ids[:j], skip_special_tokens=skip_special_tokens)
                # Streamed text never has to be taken back: it is a prefix of every later decode.
                assert whole.startswith(text) and tok.decode(ids, skip_special_tokens=skip_special_tokens
                                                             ).startswith(text), (name, ids[:j])
                held_back += text != whole
            final = detok.update(tok, ids, final=True)
            assert final == tok.decode(ids, skip_special_tokens=skip_special_tokens), (name, ids)
        assert held_back > 50, f"{name}: no incomplete character was ever held back: the test proves little"


def test_detokenization_decodes_only_the_new_tokens(llm, monkeypatch):
    """Streaming a completion with a stop string decodes O(1) tokens per step (not the whole completion each
    step), and its text equals decoding the whole completion."""
    tok = llm.tokenizer
    decoded = [0]
    decode = type(tok).decode

    def counting(self, ids, *args, **kwargs):
        decoded[0] += len(ids)
        return decode(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(tok), "decode", counting)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=["never \x00 in this text"],
                            output_kind=RequestOutputKind.DELTA)
    pieces = [o.outputs[0] for o in llm.generate_iter(["The scheduler decides"], params)]
    token_ids = [t for p in pieces for t in p.token_ids]
    assert len(token_ids) == 60
    assert "".join(p.text for p in pieces) == decode(tok, token_ids, skip_special_tokens=True)
    # A few tokens of context per step (more while a character is incomplete); re-decoding the completion every
    # step would be 60 * 61 / 2 = 1,830 tokens.
    assert decoded[0] < 12 * 60, f"{decoded[0]} tokens decoded for a 60-token completion"


# ----------------------------------------------------------------------------------------------------------
# logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens
# ----------------------------------------------------------------------------------------------------------

EOS = 0  # the test models' EOS: both engines stop there
FEATURE_PROMPTS = random_prompts(3, 5, 500, 4, 12, seed=51)


def greedy_params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, **kwargs)


def hf_generate(model_dir, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    """transformers' greedy generate with its own logits processors, cut after EOS (where it stops and pads)."""
    out = load_hf_model(model_dir).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                            **processors)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


def test_logit_bias_greedy_matches_transformers_sequence_bias(llm, qwen3_dir):
    plain = tokens_of(llm, FEATURE_PROMPTS, greedy_params())
    # Down with each plain completion's first token, up with its fourth and with two fixed tokens.
    biases = [{g[0]: -6.0, g[3]: 2.5, 300: 3.5, 17: 1.5} for g in plain]
    ours = tokens_of(llm, FEATURE_PROMPTS, [greedy_params(logit_bias=b) for b in biases])
    for prompt, b, got, before in zip(FEATURE_PROMPTS, biases, ours, plain):
        assert got != before, "the bias did not change the greedy output: the comparison proves nothing"
        assert got == hf_generate(qwen3_dir, prompt, 12, sequence_bias={(t,): v for t, v in b.items()})


def test_allowed_token_ids_greedy_matches_transformers_prefix_allowed_tokens(llm, qwen3_dir):
    plain = tokens_of(llm, FEATURE_PROMPTS, greedy_params())
    allowed = [t for t in range(100, 160) if t not in {g[0] for g in plain}] + [EOS]
    ours = tokens_of(llm, FEATURE_PROMPTS, greedy_params(allowed_token_ids=allowed))
    for prompt, got, before in zip(FEATURE_PROMPTS, ours, plain):
        assert got != before and set(got) <= set(allowed)
        assert got == hf_generate(qwen3_dir, prompt, 12, prefix_allowed_tokens_fn=lambda batch, ids: allowed)


def round_trip_word(tok, ids: list[int]) -> str | None:
    """The text of ids if it encodes back to exactly ids (so that banning the word bans those tokens)."""
    text = tok.decode(ids)
    return text if tok.encode(text.lstrip(), add_special_tokens=False) == ids else None


def test_bad_words_greedy_matches_transformers_bad_words_ids(llm, qwen3_dir):
    tok = llm.tokenizer
    plain = tokens_of(llm, FEATURE_PROMPTS, greedy_params())
    for prompt, before in zip(FEATURE_PROMPTS, plain):
        # A word of one token, always banned, and one of two, banned once its first token was generated.
        single = next(w for t in before if (w := round_trip_word(tok, [t])) is not None)
        pair = next(w for k in range(1, len(before)) if (w := round_trip_word(tok, before[k - 1:k + 1])))
        words = bad_words_token_ids([single, pair], tok)
        got = tokens_of(llm, [prompt], greedy_params(bad_words=[single, pair]))[0]
        assert got != before and all(tuple(w) not in zip(*(got[i:] for i in range(len(w)))) for w in words)
        # transformers matches a word's first tokens against the prompt too, vLLM only against generated tokens:
        # that must not matter here for the comparison to hold.
        assert all(len(w) == 1 or prompt[-1] != w[0] for w in words)
        assert got == hf_generate(qwen3_dir, prompt, 12, bad_words_ids=words)


def test_bad_words_ban_only_what_the_generated_tokens_would_complete():
    """vLLM's rule on token ids: a word's last token is banned when the generated tokens (not the prompt) end with
    its other tokens; a one-token word always."""
    words = ((9,), (5, 7), (4, 5, 8), (3, 4, 5, 6), (2, 6), (5, 5, 4))
    seq = Sequence([1, 2, 3], SamplingParams(), 4, bad_words_token_ids=words)
    assert bad_word_bans(seq) == [9]  # nothing generated: (2, 6) is not completed by the prompt's last token
    seq.token_ids += [4, 5]
    assert bad_word_bans(seq) == [9, 7, 8]  # (3, 4, 5, 6) needs the prompt's 3: not banned
    # A token sampled but not yet on the host (async scheduling's step in flight) counts as generated.
    assert bad_word_bans(seq, (5,)) == [9, 7, 4]
    seq.token_ids.pop()
    assert bad_word_bans(seq, (5,)) == [9, 7, 8]


def test_bad_words_tokenized_as_vllm_does(llm):
    """Each word left-stripped, and after a space where that gives a different first token in as many tokens."""
    tok = llm.tokenizer
    p, spaced_p = tok.encode("p", add_special_tokens=False), tok.encode(" p", add_special_tokens=False)
    hello, spaced_hello = (tok.encode(w, add_special_tokens=False) for w in ("hello", " hello"))
    assert len(p) == len(spaced_p) and p[0] != spaced_p[0] and len(spaced_hello) != len(hello)
    assert bad_words_token_ids(["p", "  hello"], tok) == [p, spaced_p, hello]


def test_rows_without_the_features_are_unchanged_in_a_mixed_batch(llm):
    """Seeded sampling is batch-independent on the CPU: every row gives what it gives alone, with or without the
    new features beside it, and the features do change their own rows."""
    prompts = random_prompts(4, 5, 500, 5, 12, seed=52)
    features = dict(logit_bias={300: 4.0, 17: -3.0}, allowed_token_ids=list(range(0, 400, 3)), bad_words=["p"])
    params = [SamplingParams(temperature=0.9, seed=1, max_tokens=10, ignore_eos=True, **features),
              SamplingParams(temperature=0.9, seed=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={300: 2.0})]
    together = tokens_of(llm, prompts, params)
    alone = [tokens_of(llm, [p], q)[0] for p, q in zip(prompts, params)]
    assert together == alone
    without = dataclasses.replace(params[0], logit_bias=None, allowed_token_ids=None, bad_words=None)
    assert tokens_of(llm, prompts[:1], without)[0] != together[0]
    assert set(together[0]) <= set(features["allowed_token_ids"])


@pytest.fixture
def penalized_logits(monkeypatch):
    """Per request id, every sampled step: (token ids so far, the logits greedy rows take the argmax of)."""
    captured = defaultdict(list)
    sample_ = ModelRunner.sample

    def recording(self, seqs, logits):
        penalized = self.sampler.penalize(logits, self._sampling_metadata(seqs, logits.shape[-1]))
        for seq, row in zip(seqs, penalized):
            captured[seq.request_id].append((list(seq.token_ids), row.clone()))
        return sample_(self, seqs, logits)

    monkeypatch.setattr(ModelRunner, "sample", recording)
    return captured


def vllm_processed(logits: torch.Tensor, ids: list[int], num_prompt: int, p: SamplingParams,
                   words: list[list[int]], bias_last: bool = False) -> torch.Tensor:
    """vLLM v1's processing of one row's logits, written out: allowed_token_ids, bad words, min_tokens (stop and
    EOS tokens), logit_bias, then repetition, frequency, presence penalties (bias_last: the bias after them)."""
    x, generated = logits.clone(), ids[num_prompt:]
    x[~torch.isin(torch.arange(len(x)), torch.tensor(p.allowed_token_ids))] = float("-inf")
    for w in words:
        if len(w) - 1 <= len(generated) and generated[len(generated) - len(w) + 1:] == w[:-1]:
            x[w[-1]] = float("-inf")
    if len(generated) < p.min_tokens:
        x[[EOS, *p.stop_token_ids]] = float("-inf")
    bias = torch.zeros_like(x).index_put_((torch.tensor(list(p.logit_bias)),), torch.tensor(list(
        p.logit_bias.values())))
    x = x if bias_last else x + bias
    x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x[None])[0]
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(x)).float()
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return x + bias if bias_last else x


def test_features_with_penalties_and_min_tokens_in_vllms_order(qwen3_dir, penalized_logits):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=MAX_LEN)
    prompt = random_prompts(1, 100, 130, 12, 12, seed=53)[0]
    allowed = list(range(100, 130)) + [EOS]  # the prompt's range: tokens repeat, so the penalties act
    bad_word = next(w for t in allowed if (w := round_trip_word(llm.tokenizer, [t])) is not None)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=14, min_tokens=5, stop_token_ids=[prompt[0]],
                            allowed_token_ids=allowed, bad_words=[bad_word, "p"], repetition_penalty=1.8,
                            presence_penalty=0.7, frequency_penalty=0.4,
                            logit_bias={t: (-1) ** t * 2.5 for t in prompt[:8]} | {EOS: 4.0})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    words = bad_words_token_ids(params.bad_words, llm.tokenizer)
    steps = penalized_logits[out.request_id]
    assert len(steps) == len(out.outputs[0].token_ids) >= 5
    order_matters = 0.0
    for ids, ours in steps:
        logits = hf_forward_logits(qwen3_dir, ids)[-1]
        ref = vllm_processed(logits, ids, len(prompt), params, words)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        kept = ~torch.isinf(ref)
        assert (ours[kept] - ref[kept]).abs().max() < 1e-4
        wrong = vllm_processed(logits, ids, len(prompt), params, words, bias_last=True)
        order_matters = max(order_matters, (wrong[kept] - ref[kept]).abs().max().item())
    assert order_matters > 0.1, "bias before or after the penalties gives the same logits: the test proves nothing"


def test_truncate_prompt_tokens_equals_running_the_truncated_prompt(llm):
    prompt = random_prompts(1, 5, 500, 20, 20, seed=54)[0]
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=6, max_tokens=10, ignore_eos=True)):
        truncated = llm.generate([prompt], dataclasses.replace(params, truncate_prompt_tokens=7), use_tqdm=False)[0]
        assert truncated.prompt_token_ids == prompt[-7:]
        assert truncated.outputs[0].token_ids == tokens_of(llm, [prompt[-7:]], params)[0]
        assert truncated.outputs[0].token_ids != tokens_of(llm, [prompt], params)[0]
        # -1 keeps the last max_model_len tokens; a k longer than the prompt keeps it all.
        for keep in (-1, 50):
            whole = llm.generate([prompt], dataclasses.replace(params, truncate_prompt_tokens=keep),
                                 use_tqdm=False)[0]
            assert whole.prompt_token_ids == prompt and whole.outputs[0].token_ids == tokens_of(llm, [prompt],
                                                                                               params)[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_with_the_token_features_is_the_same_on_cuda_and_cpu(qwen3_dir, llm):
    params = [greedy_params(logit_bias={300: 3.5, 17: 1.5}), greedy_params(allowed_token_ids=list(range(100, 160))),
              greedy_params(bad_words=["p", "\x00ver"], logit_bias={311: 2.0}), greedy_params()]
    prompts = random_prompts(4, 5, 500, 4, 12, seed=55)
    with LLM(str(qwen3_dir), device="cuda", dtype="float32", max_model_len=MAX_LEN, num_kvcache_blocks=64) as on_cuda:
        assert tokens_of(on_cuda, prompts, params) == tokens_of(llm, prompts, params)
