"""vLLM's generation API: each sampling feature's processed logits against transformers' logits processors,
stop strings, logprobs and prompt logprobs against transformers' log_softmax, n > 1 on shared prefix blocks,
streaming and abort, chat, and decode mixed with prefill chunks under one token budget."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from collections import defaultdict

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from models import check_against_hf, hf_forward_logits, hf_greedy, random_prompts
from nanoinfer import LLM, BeamSearchParams, RequestOutputKind, SamplingParams
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.scheduler import Scheduler

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=8)


def assert_idle(llm):
    engine = llm.llm_engine
    assert engine.scheduler.is_finished() and not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks.values())


# ----------------------------------------------------------------------------------------------------------
# Each sampling feature against transformers' logits processors
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def processed(monkeypatch):
    """Per request id, every sampled step: (token ids so far, logits greedy rows take the argmax of, logits whose
    softmax sampled rows draw from)."""
    captured = defaultdict(list)
    sample = ModelRunner.sample

    def recording(self, seqs, logits):
        m = self._sampling_metadata(seqs, logits.shape[-1])
        penalized, warped = self.sampler.penalize(logits, m), self.sampler.processed_logits(logits, m)
        for seq, p, w in zip(seqs, penalized, warped):
            captured[seq.request_id].append((list(seq.token_ids), p.clone(), w.clone()))
        return sample(self, seqs, logits)

    monkeypatch.setattr(ModelRunner, "sample", recording)
    return captured


def vllm_presence_frequency(presence: float, frequency: float):
    """vLLM's definition (transformers has none): logits - frequency * count - presence * [count > 0], where count
    is how often the token occurs in the generated tokens (not the prompt)."""
    def apply(ids: torch.Tensor, scores: torch.Tensor, num_prompt: int) -> torch.Tensor:
        counts = torch.bincount(ids[0, num_prompt:], minlength=scores.shape[-1]).float()
        return scores - frequency * counts - presence * (counts > 0).float()
    return apply


def hf(*processors):
    def apply(ids, scores, num_prompt):
        for p in processors:
            scores = p(ids, scores)
        return scores
    return apply


EOS = [0]  # qwen3 test model
FEATURES = {
    "repetition_penalty": (dict(temperature=0.8, repetition_penalty=1.6),
                           hf(RepetitionPenaltyLogitsProcessor(1.6), TemperatureLogitsWarper(0.8))),
    "min_p": (dict(temperature=0.9, min_p=0.08), hf(TemperatureLogitsWarper(0.9), MinPLogitsWarper(0.08))),
    "top_k": (dict(temperature=1.0, top_k=7), hf(TopKLogitsWarper(7))),
    "top_p": (dict(temperature=0.7, top_p=0.6), hf(TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.6))),
    "combined": (dict(temperature=0.7, repetition_penalty=1.3, top_k=20, top_p=0.8),
                 hf(RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                    TopPLogitsWarper(0.8))),
    "presence_frequency": (dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7),
                           vllm_presence_frequency(1.5, 0.7)),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_processed_logits_match_transformers_processors(feature, qwen3_dir, processed, report_logit_diff):
    kwargs, reference = FEATURES[feature]
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128)
    # A short vocabulary range makes repeats (what the penalties act on) frequent in prompt and output.
    prompts = random_prompts(3, 5, 40, 6, 20, seed=31)
    params = SamplingParams(seed=5, max_tokens=10, ignore_eos=True, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    worst, changed = 0.0, 0.0
    for out in outs:
        steps = processed[out.request_id]
        assert len(steps) == 10 and steps[-1][0][len(out.prompt_token_ids):] == out.outputs[0].token_ids[:-1]
        for ids, _, ours in steps:
            logits = hf_forward_logits(qwen3_dir, ids)[-1:]
            ref = reference(torch.tensor([ids]), logits.clone(), len(out.prompt_token_ids))[0]
            plain = logits[0] / kwargs["temperature"]
            assert torch.equal(torch.isinf(ours), torch.isinf(ref)), f"{feature}: different tokens filtered"
            kept = ~torch.isinf(ref)
            worst = max(worst, (ours[kept] - ref[kept]).abs().max().item())
            torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-5, rtol=0)
            changed = max(changed, float("inf") if (~kept).any() else (ref - plain).abs().max().item())
    report_logit_diff(f"processed logits, {feature}", worst)
    assert worst < ATOL, f"{feature}: max |processed logit diff| {worst:.2e}"
    assert changed > 0.1, f"{feature} had no effect on these logits: the comparison proves nothing"


def test_min_tokens_masks_eos_like_transformers(qwen3_dir, processed):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128)
    prompt = random_prompts(1, 5, 500, 12, 12, seed=32)[0]
    params = SamplingParams(temperature=1.0, seed=3, min_tokens=4, max_tokens=8, stop_token_ids=[7])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    steps = processed[out.request_id]
    for i, (ids, _, ours) in enumerate(steps):
        logits = hf_forward_logits(qwen3_dir, ids)[-1:]
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), 4, EOS + [7])(torch.tensor([ids]), logits)[0]
        assert torch.isinf(ours[EOS + [7]]).all() == (i < 4) and torch.isinf(ref[EOS + [7]]).all() == (i < 4)
        kept = ~torch.isinf(ref)
        assert torch.equal(kept, ~torch.isinf(ours)) and (ours[kept] - ref[kept]).abs().max() < ATOL


def test_greedy_takes_the_argmax_of_penalized_logits(qwen3_dir, processed):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128)
    prompts = random_prompts(2, 5, 30, 8, 16, seed=33)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, max_tokens=12,
                            ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids[:12] for o in plain]
    for out in outs:
        for (ids, ours, _), token in zip(processed[out.request_id], out.outputs[0].token_ids):
            logits = hf_forward_logits(qwen3_dir, ids)[-1:]
            ref = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([ids]), logits)
            ref = vllm_presence_frequency(0.0, 0.5)(torch.tensor([ids]), ref, len(out.prompt_token_ids))[0]
            assert (ours - ref).abs().max() < ATOL and token == int(ref.argmax())


# ----------------------------------------------------------------------------------------------------------
# Stops
# ----------------------------------------------------------------------------------------------------------

def test_stop_string_spanning_two_tokens(llm):
    prompt = "The scheduler decides"
    tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.tokenizer
    texts = [tok.decode(tokens[:j], skip_special_tokens=True) for j in range(len(tokens) + 1)]
    # A stop string made of the last character of token i and the first of token i + 1, seen nowhere before.
    for i in range(2, len(tokens) - 1):
        cut = len(texts[i + 1])
        stop = texts[i + 2][cut - 1:cut + 1]
        if (len(texts[i + 1]) > len(texts[i]) and len(texts[i + 2]) > cut and "\ufffd" not in texts[i + 2]
                and texts[i + 2].find(stop) == cut - 1):
            break
    else:
        pytest.fail("no token boundary to place a stop string across")
    base = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=["never in this text \x00", stop])
    out = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:i + 2], "generation goes on past the token completing the stop string"
    assert (out.text, out.finish_reason, out.stop_reason) == (texts[i + 2][:cut - 1], "stop", stop)
    kept = llm.generate(prompt, SamplingParams(**base, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == texts[i + 2][:cut + 1] and kept.outputs[0].token_ids == tokens[:i + 2]
    # min_tokens defers every stop: the string is not looked for before then.
    late = llm.generate(prompt, SamplingParams(**base, min_tokens=i + 2 + 1), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > i + 2


def test_stop_token_ids_and_reasons(llm):
    prompt = [9, 10, 11, 12]
    tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(j for j, t in enumerate(tokens) if t not in tokens[:j] and j >= 2)
    out = llm.generate([prompt], dataclasses.replace(GREEDY, stop_token_ids=[tokens[stop_at]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[stop_at])
    length = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert (length.finish_reason, length.stop_reason) == ("length", None)


# ----------------------------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------------------------

def check_logprobs(entry: dict, actual: int, ref: torch.Tensor, k: int) -> float:
    """entry maps token id -> Logprob; ref is transformers' log_softmax at that position."""
    assert actual in entry and len(entry) in (k, k + 1)
    ranks = {t: lp.rank for t, lp in entry.items()}
    assert (ref > ref[actual] + ATOL).sum() + 1 <= ranks[actual] <= (ref >= ref[actual] - ATOL).sum()
    if k:
        kth = ref.topk(k).values[-1]
        assert all(ref[t] >= kth - ATOL for t in entry if t != actual), "an entry outside transformers' top k"
    return max(abs(lp.logprob - ref[t].item()) for t, lp in entry.items())


@pytest.mark.parametrize("budget, max_num_seqs", [(4096, 256), (5, 256), (32, 2)],
                         ids=["one-chunk", "chunked-prefill", "logit-chunks"])
def test_logprobs_and_prompt_logprobs_match_transformers(qwen2_dir, budget, max_num_seqs, report_logit_diff):
    """logit-chunks: a step's prompt logprobs from the logits of 2 rows at a time (see ModelRunner.logit_results)."""
    llm = LLM(str(qwen2_dir), device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=budget,
              max_num_seqs=max_num_seqs, kvcache_block_size=8)
    assert llm.llm_engine.model_runner.logit_chunk_rows == max(max_num_seqs, -(-budget // 16))
    prompts = random_prompts(3, 5, 440, 9, 30, seed=34)
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    worst = 0.0
    for _ in range(2):  # the second time the prompts are cached, but prompt logprobs need every position
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, prompt in zip(outs, prompts):
            c = out.outputs[0]
            ref = hf_forward_logits(qwen2_dir, prompt + c.token_ids).log_softmax(-1)
            assert len(c.logprobs) == 6 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for j, token in enumerate(c.token_ids):
                worst = max(worst, check_logprobs(c.logprobs[j], token, ref[len(prompt) - 1 + j], 3))
            for j in range(1, len(prompt)):
                worst = max(worst, check_logprobs(out.prompt_logprobs[j], prompt[j], ref[j - 1], 2))
            assert c.cumulative_logprob == pytest.approx(sum(c.logprobs[j][t].logprob
                                                             for j, t in enumerate(c.token_ids)))
            assert out.num_cached_tokens == 0
    report_logit_diff(f"logprobs, budget {budget}", worst)
    assert worst < ATOL, f"max |logprob diff| {worst:.2e}"
    # Without logprobs there is no cumulative logprob (vLLM's convention) and the cache is used again.
    plain = llm.generate(prompts, dataclasses.replace(params, logprobs=None, prompt_logprobs=None), use_tqdm=False)
    assert all(o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None and o.prompt_logprobs is None
               for o in plain)
    assert plain[2].num_cached_tokens > 0


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_the_logits_vllm_reports(qwen3_dir, mode):
    """vLLM's logprobs_mode, in a step mixing a sampled row (penalty, temperature, top-k, top-p: processed as
    transformers' processors do) with a greedy one (processed: only penalized, at temperature 1). The tokens are
    those of the default mode: only what is reported changes."""
    prompts = random_prompts(2, 5, 40, 6, 20, seed=31)
    sampled = SamplingParams(seed=5, max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.7,
                             repetition_penalty=1.3, top_k=20, top_p=0.8)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True, logprobs=3)
    references = (FEATURES["combined"][1], hf(RepetitionPenaltyLogitsProcessor(1.3)))
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128) as plain:
        want = plain.generate(prompts, [sampled, greedy], use_tqdm=False)
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128, logprobs_mode=mode) as llm:
        outs = llm.generate(prompts, [sampled, greedy], use_tqdm=False)
    for out, reference, other in zip(outs, references, want):
        c, ids = out.outputs[0], list(out.prompt_token_ids)
        assert c.token_ids == other.outputs[0].token_ids
        for token, entry in zip(c.token_ids, c.logprobs):
            logits = hf_forward_logits(qwen3_dir, ids)[-1:]
            ref = logits[0] if mode == "raw_logits" else reference(torch.tensor([ids]), logits.clone(), len(ids))[0]
            ref = ref.log_softmax(-1) if mode == "processed_logprobs" else ref
            assert token in entry and len(entry) >= 3
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref[t]), abs=ATOL) and lp.rank == int((ref >= ref[t]).sum())
            ids.append(token)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))


def test_bad_logprobs_mode_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match="logprobs_mode must be one of .* got 'processed'"):
        LLM(str(qwen3_dir), device="cpu", logprobs_mode="processed")
    with LLM(str(qwen3_dir), device="cpu", max_model_len=128, logprobs_mode="raw_logits") as llm:
        with pytest.raises(ValueError, match="beam search ranks beams by logprobs: .*'raw_logits'"):
            llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3))


def test_greedy_logprobs_rank_one_and_decoded_tokens(llm):
    out = llm.generate("The quick brown fox", dataclasses.replace(GREEDY, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    assert all(entry[t].rank == 1 and entry[t].decoded_token == llm.tokenizer.decode([t])
               for entry, t in zip(out.logprobs, out.token_ids))


def test_logprobs_minus_one_gives_the_whole_vocabulary(llm):
    vocab = llm.llm_engine.vocab_size
    prompt = random_prompts(1, 5, 500, 6, 6, seed=37)[0]
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=3, logprobs=5, prompt_logprobs=5)
    top = llm.generate([prompt], params, use_tqdm=False)[0]
    whole = llm.generate([prompt], dataclasses.replace(params, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert whole.outputs[0].token_ids == top.outputs[0].token_ids
    for full, five in zip(whole.outputs[0].logprobs + whole.prompt_logprobs[1:],
                          top.outputs[0].logprobs + top.prompt_logprobs[1:]):
        assert len(full) == vocab and sorted(lp.rank for lp in full.values()) == list(range(1, vocab + 1))
        assert sum(math.exp(lp.logprob) for lp in full.values()) == pytest.approx(1.0, abs=1e-4)
        for t, lp in five.items():
            assert full[t].rank == lp.rank and full[t].logprob == pytest.approx(lp.logprob, abs=1e-5)
            assert full[t].decoded_token == lp.decoded_token == llm.tokenizer.decode([t])
    assert_idle(llm)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, monkeypatch):
    """vLLM's detokenize=False: the same token ids, logprobs and finish reasons, stop token ids included, with the
    text left empty and no decoded_token, in full and streamed outputs; the tokenizer never decodes."""
    prompts = random_prompts(3, 5, 400, 3, 20, seed=8)
    base = dict(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=1, stop_token_ids=[202, 139])
    want = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    assert all(o.outputs[0].text for o in want)
    monkeypatch.setattr(type(llm.tokenizer), "decode", lambda *a, **k: pytest.fail("decoded with detokenize=False"))
    got = llm.generate(prompts, SamplingParams(**base, detokenize=False), use_tqdm=False)
    for out, ref in zip(got, want):
        c, r = out.outputs[0], ref.outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (r.token_ids, r.finish_reason, r.stop_reason)
        assert c.text == ""
        assert [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs] == \
            [{t: lp.logprob for t, lp in e.items()} for e in r.logprobs]
        assert all(lp.decoded_token is None for e in c.logprobs + out.prompt_logprobs[1:] for lp in e.values())
    streamed = list(llm.generate_iter(prompts[:1], SamplingParams(**base, detokenize=False,
                                                                  output_kind=RequestOutputKind.DELTA)))
    assert [t for o in streamed for t in o.outputs[0].token_ids] == want[0].outputs[0].token_ids
    assert all(o.outputs[0].text == "" for o in streamed)


# ----------------------------------------------------------------------------------------------------------
# Priority scheduling
# ----------------------------------------------------------------------------------------------------------

GREEDY_LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def first_preempted(qwen3_dir, policy: str, priority: list[int] | None, monkeypatch) -> tuple[list, list[str]]:
    """Three prompts (request ids "0", "1", "2") decoding together in a cache too small for all: the outputs, and the
    request ids of the sequences preempted, in order."""
    preempted, real = [], Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: preempted.append(seq.request_id) or real(self, seq))
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=64, kvcache_block_size=4,
             num_kvcache_blocks=24, scheduling_policy=policy) as llm:
        outputs = llm.generate(random_prompts(3, 5, 400, 10, 12, seed=3), GREEDY_LONG, use_tqdm=False,
                               priority=priority)
    return [o.outputs[0].token_ids for o in outputs], preempted


def test_priority_admits_lower_values_first_and_preempts_the_last_ranked(qwen3_dir, monkeypatch):
    """scheduling_policy="priority" (vLLM's): waiting requests are admitted by (priority, arrival), and out of blocks
    the running one that ranks last goes back (first come, first served: the latest admitted). Every request still
    gets a plain run's tokens."""
    prompts = random_prompts(3, 5, 400, 4, 8, seed=2)
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=1,
             scheduling_policy="priority") as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
        order = sorted(range(3), key=lambda i: outputs[i].metrics.first_scheduled_time)
        plain = llm.generate(prompts, GREEDY, use_tqdm=False)  # all priority 0: arrival order
        assert sorted(range(3), key=lambda i: plain[i].metrics.first_scheduled_time) == [0, 1, 2]
    assert order == [1, 2, 0]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    fcfs_tokens, fcfs_victims = first_preempted(qwen3_dir, "fcfs", None, monkeypatch)
    monkeypatch.undo()
    tokens, victims = first_preempted(qwen3_dir, "priority", [0, 5, 1], monkeypatch)
    assert fcfs_victims[0] == "2" and victims[0] == "1"  # the latest admitted; the one ranked last
    assert tokens == fcfs_tokens


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(priority=[1]), ValueError, "priority=1 needs scheduling_policy='priority'"),
    (dict(priority=[0, 0]), ValueError, "got 2 priorities for 1 prompts"),
    (dict(priority=3), TypeError, "priority must be a list of ints"),
    (dict(priority=["1"]), TypeError, "priority must be an int, got '1'"),
])
def test_bad_priorities_are_refused_and_the_engine_stays_usable(llm, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, **kwargs)
    assert_idle(llm)
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids


def test_bad_scheduling_policy_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        LLM(str(qwen3_dir), device="cpu", scheduling_policy="lifo")


# ----------------------------------------------------------------------------------------------------------
# n > 1
# ----------------------------------------------------------------------------------------------------------

def test_n_completions_share_prompt_blocks_and_are_reproducible(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=8)
    prompt = random_prompts(1, 5, 500, 37, 37, seed=35)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("r", prompt, params)
    engine.step()
    tables = [s.block_table for s in engine.requests["r"]]
    bm = engine.scheduler.block_manager
    # 36 of 37 prompt tokens fill 4 blocks of 8 (the last token is always computed): shared by all three.
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert [bm.blocks[b].ref_count for b in tables[0]] == [3, 3, 3, 3, 1]
    assert len({t[4] for t in tables}) == 3
    engine.abort_request("r")
    assert bm.num_free_blocks == bm.num_blocks

    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 8 for c in out.outputs)
    assert out.num_cached_tokens == 3 * 32  # summed over completions: all three found the prompt cached
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # Completion i draws from seed + i (as in vLLM): the same as a single request with that seed.
    singles = [llm.generate([prompt], dataclasses.replace(params, n=1, seed=11 + i), use_tqdm=False)[0]
               for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_idle(llm)


def test_reset_prefix_cache_forgets_cached_prompts_only_when_no_request_holds_blocks(llm):
    prompt = random_prompts(1, 5, 500, 37, 37, seed=36)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    llm.llm_engine.add_request("holding", prompt[:20], GREEDY)
    llm.llm_engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing is forgotten
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    llm.llm_engine.abort_request("holding")
    assert llm.reset_prefix_cache() is True
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32  # cached again
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Streaming, step API, abort
# ----------------------------------------------------------------------------------------------------------

def test_generate_iter_streams_each_token_and_ends_like_generate(llm):
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9]]
    params = [dataclasses.replace(GREEDY, max_tokens=6), dataclasses.replace(GREEDY, max_tokens=9)]
    final = llm.generate(prompts, params, use_tqdm=False)
    seen = defaultdict(list)
    for out in llm.generate_iter(prompts, params):
        seen[tuple(out.prompt_token_ids)].append(out)
    for want in final:
        stream = seen[tuple(want.prompt_token_ids)]
        n = len(want.outputs[0].token_ids)
        assert [len(o.outputs[0].token_ids) for o in stream] == list(range(1, n + 1))
        assert [o.finished for o in stream] == [False] * (n - 1) + [True]
        assert stream[-1].outputs[0] == want.outputs[0]
        m = stream[-1].metrics
        assert m.num_generation_tokens == n and m.time_to_first_token > 0
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    deltas = defaultdict(list)
    for out in llm.generate_iter(prompts, [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA) for p in params]):
        deltas[tuple(out.prompt_token_ids)].append(out.outputs[0])
    for want in final:
        parts = deltas[tuple(want.prompt_token_ids)]
        assert sum((p.token_ids for p in parts), []) == want.outputs[0].token_ids
        assert "".join(p.text for p in parts) == want.outputs[0].text
    assert_idle(llm)


def test_breaking_out_of_a_stream_aborts_and_frees(llm):
    baseline = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stream = llm.generate_iter([[5, 6, 7], list(range(20, 60))], dataclasses.replace(GREEDY, max_tokens=20))
    for i, _ in enumerate(stream):
        with pytest.raises(RuntimeError, match="generate_iter"):
            llm.generate([[1, 2]], GREEDY, use_tqdm=False)  # the open stream owns the engine
        if i == 2:
            break
    stream.close()
    assert_idle(llm)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline


def test_step_api_abort_request_frees_blocks_and_others_continue(llm):
    engine = llm.llm_engine
    alone = llm.generate([[30, 31, 32]], dataclasses.replace(GREEDY, max_tokens=12), use_tqdm=False)[0]
    engine.add_request("keep", [30, 31, 32], dataclasses.replace(GREEDY, max_tokens=12))
    engine.add_request("drop", list(range(40, 90)), dataclasses.replace(GREEDY, max_tokens=12))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("drop", [1], GREEDY)
    for _ in range(3):
        engine.step()
    bm = engine.scheduler.block_manager
    used = bm.num_blocks - bm.num_free_blocks
    engine.abort_request("drop")
    assert bm.num_blocks - bm.num_free_blocks == used - 7  # 53 tokens in blocks of 8
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert finished[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Chat
# ----------------------------------------------------------------------------------------------------------

def test_chat_applies_the_template(llm):
    tok = llm.tokenizer
    assert llm.get_tokenizer() is tok  # vLLM's accessor
    conversation = [{"role": "user", "content": "What is a KV cache?"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    ids = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    assert out.prompt_token_ids == list(ids if isinstance(ids, list) else ids["input_ids"])
    assert out.prompt == "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n"
    direct = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    both = llm.chat([conversation, other], GREEDY, use_tqdm=False)
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids and both[1].prompt.startswith("<|im_start|>system")
    for bad in ("hello", [], [[]], [{"role": "user", "content": "x"}, "y"]):
        with pytest.raises(TypeError, match="conversation"):
            llm.chat(bad, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_chat_takes_openai_messages_tools_and_continues_the_final_message(llm):
    plain = llm.chat([{"role": "user", "content": "Say hi\nplease"}], GREEDY, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi"},
                                                   {"type": "text", "text": "please"}]}], GREEDY, use_tqdm=False)[0]
    assert parts.prompt == plain.prompt and parts.outputs[0].token_ids == plain.outputs[0].token_ids

    started = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    out = llm.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is"

    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<|im_start|>"
                "{{ m.role }}\n{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
                "{% endfor %}{{ m.content or '' }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\n' }}")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "0", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "0", "content": "sunny"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == ("[weather]<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
                          "weather(Paris)<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    direct = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, untouched
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Decode mixed with prefill chunks under one token budget
# ----------------------------------------------------------------------------------------------------------

def run_staggered(llm, arrivals: list[tuple[int, list[int]]], params) -> tuple[list, int]:
    """Add prompt i at step arrivals[i][0]; return the finished outputs in arrival order and the number of
    steps that computed decode tokens and prompt chunks together."""
    engine, outs, mixed, step = llm.llm_engine, {}, 0, 0
    while step == 0 or engine.has_unfinished_requests() or any(s >= step for s, _ in arrivals):
        for i, (at, prompt) in enumerate(arrivals):
            if at == step:
                engine.add_request(f"s{i}", prompt, params)
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        batch = engine.last_batch
        assert sum(batch.num_new_tokens) <= engine.config.max_num_batched_tokens
        rows = [n for s, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens) if start >= s.num_prompt_tokens]
        mixed += bool(rows) and len(rows) < len(batch.seqs)
        step += 1
    return [outs[f"s{i}"] for i in range(len(arrivals))], mixed


def test_decode_continues_while_long_prompts_are_prefilled(qwen2_dir, captured_logits, report_logit_diff):
    llm = LLM(str(qwen2_dir), device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompts = random_prompts(4, 5, 440, 3, 6, seed=36) + random_prompts(2, 5, 440, 100, 140, seed=37)
    arrivals = [(0, prompts[0]), (0, prompts[1]), (2, prompts[4]), (3, prompts[2]), (5, prompts[5]),
                (9, prompts[3])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, mixed = run_staggered(llm, arrivals, params)
    assert mixed >= 10, f"only {mixed} steps mixed decode with prefill"
    refs = hf_greedy(qwen2_dir, [p for _, p in arrivals], 24)
    worst = check_against_hf(outs, refs, captured_logits)
    report_logit_diff("qwen2, decode mixed with prefill chunks", worst)
    assert worst < ATOL
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for _, p in arrivals]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_mixed_schedule_with_preemption_and_prefix_hits_matches_hf(llama_dir, captured_logits, report_logit_diff):
    shared = random_prompts(1, 5, 440, 40, 40, seed=38)[0]
    tails = random_prompts(5, 5, 440, 2, 30, seed=39)
    arrivals = [(0, shared + tails[0]), (1, shared + tails[1]), (1, tails[2]), (4, shared + tails[3]),
                (6, shared + tails[4]), (8, shared)]
    llm = LLM(str(llama_dir), device="cpu", dtype="float32",
              max_model_len=96, num_kvcache_blocks=12, max_num_batched_tokens=24,
              kvcache_block_size=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, mixed = run_staggered(llm, arrivals, params)
    assert mixed > 0 and llm.llm_engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) >= 3 * 40
    worst = check_against_hf(outs, hf_greedy(llama_dir, [p for _, p in arrivals], 24), captured_logits)
    report_logit_diff("llama, mixed schedule with preemption and prefix hits", worst)
    assert worst < ATOL
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(n=0), ValueError, "n must"),
    (dict(n=2.0), TypeError, "n must"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty"),
    (dict(presence_penalty=2.5), ValueError, "presence_penalty"),
    (dict(frequency_penalty=-3), ValueError, "frequency_penalty"),
    (dict(frequency_penalty="1"), TypeError, "frequency_penalty"),
    (dict(min_tokens=-1), ValueError, "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), ValueError, "min_tokens"),
    (dict(stop=5), TypeError, "stop"),
    (dict(stop=["ok", 3]), TypeError, "stop"),
    (dict(stop=["ok", ""]), ValueError, "stop"),
    (dict(logprobs=-2), ValueError, r"logprobs must be None, >= 0, or -1 \(the whole vocabulary\), got -2"),
    (dict(logprobs=-1, prompt_logprobs=-1), None, None),
    (dict(logprobs=1.5), TypeError, "logprobs"),
    (dict(prompt_logprobs=-2), ValueError, "prompt_logprobs"),
    (dict(include_stop_str_in_output="yes"), TypeError, "include_stop_str_in_output"),
    (dict(detokenize=0), TypeError, "detokenize must be a bool, got 0"),
    (dict(detokenize=False, stop=["\n"]), ValueError, r"stop=\['\\n'\] needs the text: stop strings need detokenize"),
    (dict(detokenize=False, stop_token_ids=[5]), None, None),
    (dict(output_kind="delta"), TypeError, "output_kind"),
    (dict(max_tokens=None, min_tokens=3), None, None),
    (dict(stop="one string"), None, None),
])
def test_new_sampling_params_validation(kwargs, exc, name):
    if exc is None:
        SamplingParams(**kwargs)
        return
    with pytest.raises(exc, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("call, exc, match", [
    (lambda e: e.add_request("x", [1, 2], SamplingParams(stop_token_ids=[512])), ValueError, "stop token id 512"),
    (lambda e: e.add_request("x", [1, 2], SamplingParams(logprobs=513)), ValueError, "logprobs=513"),
    (lambda e: e.add_request(7, [1, 2], SamplingParams()), TypeError, "request_id"),
    (lambda e: e.add_request("x", {"tokens": [1]}, SamplingParams()), ValueError, "prompt_token_ids"),
    (lambda e: e.add_request("x", [1] * 120, SamplingParams(max_tokens=None, min_tokens=10)), ValueError,
     "max_model_len"),
])
def test_bad_requests_leave_the_engine_untouched(llm, call, exc, match):
    with pytest.raises(exc, match=match):
        call(llm.llm_engine)
    assert_idle(llm)


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([[3] * 100], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"


# ----------------------------------------------------------------------------------------------------------
# Sampling defaults from the model's generation config (vLLM's generation_config="auto")
# ----------------------------------------------------------------------------------------------------------

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.01,
               "repetition_penalty": 1.1, "max_new_tokens": 6}


def with_generation_config(qwen3_dir, root, **fields):
    """A copy of the qwen3 test model whose generation_config.json also holds `fields`."""
    model = root / "model"
    shutil.copytree(qwen3_dir, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return model


def test_generate_without_sampling_params_takes_the_generation_configs_sampling_fields(qwen3_dir, tmp_path,
                                                                                         caplog):
    model = with_generation_config(qwen3_dir, tmp_path, **RECOMMENDED)
    expected = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                              max_tokens=6)
    prompts = random_prompts(3, 5, 400, 4, 12, seed=41)
    kwargs = dict(device="cpu", dtype="float32", max_model_len=64)
    with caplog.at_level(logging.INFO, logger="nanoinfer"), LLM(str(model), **kwargs) as llm:
        assert llm.get_default_sampling_params() == expected
        implicit = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
    assert "Sampling defaults from the model's generation config: temperature=0.6, top_k=20, top_p=0.95, " \
           "min_p=0.01, repetition_penalty=1.1, max_tokens=6" in caplog.text
    # The same engine seed draws the same request seeds: the defaults are exactly those parameters.
    with LLM(str(model), generation_config="vllm", **kwargs) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, expected, use_tqdm=False)] == implicit
        assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts, use_tqdm=False)] == [16] * 3
    assert all(0 < len(ids) <= 6 for ids in implicit)


def test_generation_config_from_a_folder_with_overrides(qwen3_dir, tmp_path):
    other = with_generation_config(qwen3_dir, tmp_path / "other", temperature=0.3, top_k=0)
    llm = LLM(str(qwen3_dir), device="cpu", max_model_len=64, generation_config=str(other),
              override_generation_config={"max_new_tokens": 4, "top_p": 0.5})
    # The override adds to and wins over the file; transformers' top_k 0 (no top-k) is SamplingParams' too.
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.3, top_k=0, top_p=0.5, max_tokens=4)
    assert LLM(str(qwen3_dir), device="cpu", max_model_len=64).get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("fields, kwargs, exc, match", [
    (dict(top_p=1.5), {}, ValueError, r"generation_config\.json: .*top_p"),
    ({}, dict(override_generation_config={"temperature": -1.0}), ValueError,
     "override_generation_config: .*temperature"),
    ({}, dict(override_generation_config=[("temperature", 1.0)]), TypeError, "override_generation_config"),
    ({}, dict(generation_config=5), TypeError, "generation_config"),
    ({}, dict(generation_config="/nonexistent/folder"), ValueError, "/nonexistent/folder"),
])
def test_bad_generation_config_is_refused_naming_it(qwen3_dir, tmp_path, fields, kwargs, exc, match):
    model = with_generation_config(qwen3_dir, tmp_path, **fields)
    with pytest.raises(exc, match=match):
        LLM(str(model), device="cpu", max_model_len=64, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# vLLM's tokenizer= and trust_remote_code=
# ----------------------------------------------------------------------------------------------------------

def copy_without_tokenizer(qwen3_dir, dest):
    shutil.copytree(qwen3_dir, dest, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    return dest


def test_tokenizer_from_another_folder(qwen3_dir, tmp_path):
    """A model folder without a tokenizer takes token ids only; with tokenizer= it takes text, tokenized there."""
    bare = copy_without_tokenizer(qwen3_dir, tmp_path / "bare")
    kwargs = dict(device="cpu", dtype="float32", max_model_len=64)
    with LLM(str(bare), **kwargs) as llm:
        assert llm.get_tokenizer() is None
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("The KV cache", GREEDY, use_tqdm=False)
    with LLM(str(qwen3_dir), **kwargs) as llm:
        expected = llm.generate("The KV cache", GREEDY, use_tqdm=False)[0]
    with LLM(str(bare), tokenizer=str(qwen3_dir), **kwargs) as llm:
        out = llm.generate("The KV cache", GREEDY, use_tqdm=False)[0]
    assert (out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].text) == (
        expected.prompt_token_ids, expected.outputs[0].token_ids, expected.outputs[0].text)


def test_hf_overrides_change_the_model_as_an_edited_config_does(qwen3_dir, tmp_path):
    """As a dict and as a function (which a tensor-parallel worker could not unpickle: it gets the config already
    overridden)."""
    edited = tmp_path / "edited"
    shutil.copytree(qwen3_dir, edited)
    fields = {"rms_norm_eps": 0.5, "max_position_embeddings": 96}
    (edited / "config.json").write_text(json.dumps({**json.loads((edited / "config.json").read_text()), **fields}))
    prompts = random_prompts(3, 5, 500, 5, 20, seed=38)

    def run(path, **kwargs) -> tuple[int, list[list[int]]]:
        with LLM(str(path), device="cpu", dtype="float32", **kwargs) as llm:
            return llm.llm_engine.config.max_model_len, [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]

    def override(config):
        config.rms_norm_eps, config.max_position_embeddings = 0.5, 96
        return config

    want = run(edited)
    assert want[0] == 96 and run(qwen3_dir)[1] != want[1]  # the edit changes the tokens: the checks prove something
    assert run(qwen3_dir, hf_overrides=fields) == want
    assert run(qwen3_dir, hf_overrides=override, tensor_parallel_size=2) == want


def test_hf_overrides_update_a_sub_config_in_place():
    from transformers import PretrainedConfig

    from nanoinfer.config import overridden
    text = PretrainedConfig(rms_norm_eps=1e-6, hidden_size=8)
    config = overridden(PretrainedConfig(text_config=text), {"text_config": {"rms_norm_eps": 0.5}, "extra": [1]})
    assert config.text_config is text and (text.rms_norm_eps, text.hidden_size) == (0.5, 8) and config.extra == [1]


@pytest.mark.parametrize("value, match", [
    ([("rms_norm_eps", 0.5)], "hf_overrides must be a dict of config fields or a function of the config"),
    ({1: 2}, "hf_overrides keys must be config field names"),
    (lambda config: None, "hf_overrides must return the model's config"),
])
def test_bad_hf_overrides_are_refused(qwen3_dir, value, match):
    with pytest.raises(TypeError, match=match):
        LLM(str(qwen3_dir), device="cpu", hf_overrides=value)
    with pytest.raises(ValueError, match="hidden_size=0 in .*config.json must be a positive int"):
        LLM(str(qwen3_dir), device="cpu", hf_overrides={"hidden_size": 0})


def test_trust_remote_code_lets_a_config_class_shipped_as_code_load(qwen3_dir, tmp_path):
    """A config class in the model folder's own Python (auto_map) loads only with trust_remote_code=True; the model
    still runs nanoinfer's code for its architecture, with the same tokens."""
    model = tmp_path / "custom"
    shutil.copytree(qwen3_dir, model)
    (model / "configuration_custom_qwen3.py").write_text(
        "from transformers import Qwen3Config\n\n\n"
        "class CustomQwen3Config(Qwen3Config):\n    model_type = 'custom_qwen3'\n")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="custom_qwen3", auto_map={"AutoConfig": "configuration_custom_qwen3.CustomQwen3Config"})
    (model / "config.json").write_text(json.dumps(config))
    kwargs = dict(device="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match=f"cannot read the model config {model / 'config.json'}"):
        LLM(str(model), **kwargs)
    prompts = random_prompts(2, 5, 400, 4, 12, seed=43)
    with LLM(str(model), trust_remote_code=True, **kwargs) as llm:
        assert type(llm.llm_engine.config.hf_config).__name__ == "CustomQwen3Config"
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(qwen3_dir), **kwargs) as llm:
        assert ours == [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(tokenizer="/nonexistent/tokenizer"), ValueError, "tokenizer='/nonexistent/tokenizer' holds none of"),
    (dict(tokenizer=5), TypeError, "tokenizer must be a folder path"),
    (dict(trust_remote_code="yes"), TypeError, "trust_remote_code must be a bool, got 'yes'"),
])
def test_bad_tokenizer_or_trust_remote_code_is_refused(qwen3_dir, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(str(qwen3_dir), device="cpu", max_model_len=64, **kwargs)
