"""Random engine configurations against a plain run, from fixed seeds: KV blocks of 1 to 32 tokens, caches small
enough to preempt, step budgets small enough to chunk, prefix caching on and off, n-gram drafts; requests with shared
prefixes, greedy and seeded sampling (n > 1, top-k/p, min-p, penalties, min_tokens, stop ids, logprobs); async
scheduling (steps scheduled while the previous one runs). Every
completion's tokens, finish reason and sampled-token logprobs equal the plain run's, on a second pass (prefix hits)
too. The targeted tests take these features one or two at a time; this one takes them together. On CUDA (marked,
skipped without a GPU) the same, with the Triton backend and, where the model takes them, decode graphs."""
import random

import pytest
import torch

from nanoinfer import LLM, SamplingParams

MAX_MODEL_LEN = 160
# Tokens must equal the plain run's exactly, with no allowance for near-ties: on a GPU the batch decides the order of
# fp32 reductions (~1e-6 apart). Measured on the CPU (2026-12-06, these seeds, every kind), the closest decisions
# are far from that: 3.6e-4 between the top two logits of a greedy row, 2.1e-3 between the top two log scores of a
# sampled row's race, 3.4e-5 between the logits on either side of a top-k cut.
CONFIGS_PER_KIND = 12
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


def draw_prompts(rng: random.Random, fewest: int) -> list[list[int]]:
    """`fewest` to 6 prompts: copies of one base prompt, the base cut short and extended, a stretch of it repeated
    (which n-gram drafts find), or prompts of their own."""
    base = [rng.randrange(5, 440) for _ in range(rng.randint(1, 70))]
    prompts = []
    for _ in range(rng.randint(fewest, 6)):
        kind = rng.random()
        if kind < 0.3:
            prompts.append(list(base))
        elif kind < 0.5:
            tail = [rng.randrange(5, 440) for _ in range(rng.randint(1, 30))]
            prompts.append(base[:rng.randint(0, len(base))] + tail)
        elif kind < 0.7:
            prompts.append(base[-8:] * rng.randint(2, 6))
        else:
            prompts.append([rng.randrange(5, 440) for _ in range(rng.randint(1, 90))])
    return prompts


def draw_params(rng: random.Random, seed: int) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7, seed=seed)
    if rng.random() < 0.5:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), n=rng.choice([1, 1, 2, 3]))
        for name, values, p in (("top_k", [1, 5, 50], 0.5), ("top_p", [0.5, 0.9], 0.5), ("min_p", [0.05], 0.3)):
            if rng.random() < p:
                kw[name] = rng.choice(values)
    for name, values, p in (("repetition_penalty", [1.1, 1.5], 0.2), ("presence_penalty", [0.5], 0.2),
                            ("frequency_penalty", [0.3], 0.2), ("logprobs", [2], 0.3)):
        if rng.random() < p:
            kw[name] = rng.choice(values)
    if rng.random() < 0.2:
        kw["min_tokens"] = min(kw["max_tokens"], 5)
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(5, 440)]
    return SamplingParams(**kw)


def draw_config(rng: random.Random, tight: bool, drafts: bool, ahead: bool) -> dict:
    """A cache for at least one sequence of MAX_MODEL_LEN (the engine refuses less), at most 1.5 times that; tight:
    just that, with up to 8 sequences at once, so that they preempt each other. drafts: n-gram drafts of 1-grams and
    longer, which random models' repetitive outputs find often. ahead: async scheduling."""
    block_size = rng.choice([1, 2, 4, 8, 16, 32])
    least = -(-MAX_MODEL_LEN // block_size) + 1
    config = dict(kvcache_block_size=block_size, num_kvcache_blocks=rng.randrange(least, least * 3 // 2),
                  max_num_batched_tokens=rng.choice([16, 24, 64, 256]), max_num_seqs=rng.choice([1, 2, 3, 8, 8]),
                  enable_prefix_caching=rng.random() < 0.7)
    if tight:
        config.update(num_kvcache_blocks=least, max_num_seqs=8)
    if ahead:
        config["async_scheduling"] = True
    if drafts:
        config["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3]),
                                        "prompt_lookup_min": 1, "prompt_lookup_max": rng.choice([1, 3, 5])}
    return config


def completions(outputs) -> list[tuple]:
    """(tokens, finish reason, each sampled token's logprob or None) per completion, in request order."""
    return [(tuple(c.token_ids), c.finish_reason,
             None if c.logprobs is None else [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for o in outputs for c in o.outputs]


def assert_same(got: list[tuple], want: list[tuple], where: str) -> None:
    assert len(got) == len(want)
    for i, ((tokens, reason, logprobs), (ref_tokens, ref_reason, ref_logprobs)) in enumerate(zip(got, want)):
        assert (tokens, reason) == (ref_tokens, ref_reason), f"{where}, completion {i}"
        assert logprobs == (None if ref_logprobs is None else pytest.approx(ref_logprobs, abs=1e-4)), \
            f"{where}, completion {i}: logprobs"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next", "gemma3", "deepseek-v3"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_random_schedules_match_a_plain_run(device, kind, model_dir, monkeypatch):
    """qwen3: plain attention; qwen3-next: recurrent state beside the KV cache; gemma3: sliding-window layers;
    deepseek-v3: MLA's latent cache. Across a kind's configurations, preemption, prefix hits, chunked prefill and
    drafts each happen where the engine offers them (asserted; a model with recurrent state has neither prefix
    caching nor drafts), and so do steps scheduled ahead, so the test cannot pass on a net that caught nothing."""
    d = str(model_dir(kind))
    rng = random.Random(kind)
    engine = dict(device=device, dtype="float32", max_model_len=MAX_MODEL_LEN)
    if device == "cuda":  # fp32 means fp32: cuDNN's convolutions (Qwen3-Next's) take TF32 by default
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        engine["attention_backend"] = "triton"
    preemptions = cached = chunked = drafts = caching_offered = drafts_offered = ahead = 0
    with LLM(d, **engine, enable_prefix_caching=False, num_kvcache_blocks=400, max_num_batched_tokens=4096) as plain:
        for round_ in range(CONFIGS_PER_KIND):
            tight, with_drafts, scheduled_ahead = round_ % 3 == 0, round_ % 2 == 1, round_ % 4 == 2
            prompts = draw_prompts(rng, fewest=4 if tight else 2)
            params = [draw_params(rng, seed=1000 + i) for i in range(len(prompts))]
            config = draw_config(rng, tight, with_drafts, scheduled_ahead)
            want = completions(plain.generate(prompts, params, use_tqdm=False))
            with LLM(d, **engine, **config) as llm:
                for pass_ in range(2):
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    assert_same(completions(outputs), want, f"{kind}, round {round_}, pass {pass_}, {config}")
                    cached += sum(o.num_cached_tokens for o in outputs)
                scheduler = llm.llm_engine.scheduler
                preemptions += scheduler.num_preemptions
                drafts += llm.llm_engine.spec_decode_stats.num_drafts
                ahead += scheduler.num_steps_ahead
                caching_offered += scheduler.block_manager.enable_prefix_caching
                drafts_offered += scheduler.proposer is not None
            chunked += any(len(p) > config["max_num_batched_tokens"] for p in prompts)
    caught = dict(preemptions=preemptions, chunked=chunked, cached=cached, drafts=drafts, ahead=ahead)
    assert (preemptions and chunked and ahead and (cached or not caching_offered)
            and (drafts or not drafts_offered)), caught
