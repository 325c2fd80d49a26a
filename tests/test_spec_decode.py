"""Speculative decoding with n-gram drafts: the output is exactly a plain run's (greedy tokens equal transformers',
seeded samples equal, logprobs equal) under chunked prefill, prefix hits, preemption, stops inside an accepted run,
n > 1, streaming, tensor parallelism and the CUDA-graph decode path; the proposer, the verifier's distribution and
the config's errors."""
import math

import numpy as np
import pytest
import torch

from cuda_fakes import capture_recorded_graphs
from models import QWEN3_NEXT_KINDS, cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.engine import model_runner
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.layers.sampler import exponential_race, noise_keys, verify_drafts
from nanoinfer.sampling_params import RequestOutputKind
from nanoinfer.spec_decode.config import SpeculativeConfig, parse_speculative_config
from nanoinfer.spec_decode.ngram import NgramProposer

MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Random-weight models fall into loops on some prompts: these are prompts whose greedy output repeats itself,
# so that n-gram drafts get accepted (and a few ordinary ones).
CANDIDATES = random_prompts(40, 5, 440, 2, 24, seed=11)
REPETITIVE = {"qwen3": [15, 6, 20, 0], "qwen2": [20, 35, 10, 0], "llama": [39, 26, 25, 9]}


def ngram(k: int, **lookup) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1, **lookup}


def make_llm(model_dir, spec: dict | None = None, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=kwargs.pop("max_model_len", 256),
               speculative_config=spec, **kwargs)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# ---- the proposer ----

def proposer(k: int = 3, lookup_max: int = 4, lookup_min: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, lookup_max, lookup_min))


def test_proposer_takes_the_longest_ngram_and_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9  10 11 12 13 14
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3, 8, 8, 1, 2, 3]
    # The 3-gram 1 2 3 occurs at 0 and at 10: the later one's followers; the 2-gram 2 3 also at 5 (shorter: not used).
    assert proposer().propose(0, tokens, 5) == [8, 8, 1]
    assert proposer(k=5).propose(0, tokens, 2) == [8, 8]  # the step's limit
    assert proposer(k=5).propose(0, tokens, 10) == [8, 8, 1, 2, 3]  # up to the end of the context
    assert proposer(lookup_max=2).propose(0, tokens, 5) == [8, 8, 1]  # 2 3 latest at 11
    assert proposer(lookup_max=1).propose(0, [5, 6, 5, 7, 5], 3) == [7, 5]  # the latest 5 is followed by 7 5


def test_proposer_respects_the_lookup_bounds_and_proposes_nothing_without_a_match():
    assert proposer().propose(0, [1, 2, 3, 4], 3) == []
    assert proposer().propose(0, [7], 3) == []
    assert proposer().propose(0, [7, 7], 3) == [7]
    # The 1-gram 3 recurs, but no 2-gram does: min 2 proposes nothing.
    assert proposer(lookup_min=1).propose(0, [3, 1, 2, 3], 3) == [1, 2, 3]
    assert proposer(lookup_min=2).propose(0, [3, 1, 2, 3], 3) == []
    # A 4-gram match longer than lookup_max counts as a lookup_max-gram.
    assert proposer(lookup_max=2, lookup_min=2).propose(0, [1, 2, 3, 4, 0, 1, 2, 3, 4], 2) == [0, 1]


def test_proposer_extends_each_sequences_context_and_forgets_finished_ones(qwen3_dir):
    p = proposer()
    tokens = [1, 2, 3, 9, 1, 2]
    assert p.propose(7, tokens, 3) == [3, 9, 1]
    assert p.propose(8, [4, 5, 4], 3) == [5, 4]  # another sequence: its own context
    tokens += [3, 9]  # appended since: the 4-gram 1 2 3 9 recurs
    assert p.propose(7, tokens, 3) == [1, 2, 3]
    tokens += list(range(100, 400)) + [9, 1]  # past the first buffer
    assert p.propose(7, tokens, 3) == proposer().propose(0, tokens, 3) == [2, 3, 9]
    p.forget(7)
    assert list(p.contexts) == [8]
    llm = make_llm(qwen3_dir, ngram(3))
    llm.generate([CANDIDATES[15]] * 3, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.proposer.contexts == {}


@pytest.mark.parametrize("num_blocks, budget, drafts", [(9, 8, [0, 4]), (10, 4, [2, 0]), (10, 12, [4, 4])])
def test_drafts_shrink_to_the_budget_and_the_free_blocks_and_never_preempt(num_blocks, budget, drafts):
    """Two decoding sequences of 16 tokens (4 full blocks each) with 4 drafts proposed: a draft needs a fifth block.
    Drafts leave one budget token and one free block for each later running sequence, and shrink or vanish."""
    from types import SimpleNamespace

    from nanoinfer.engine.scheduler import Scheduler
    from nanoinfer.engine.sequence import Sequence, SequenceStatus

    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=budget, kvcache_block_size=4,
                             enable_prefix_caching=True, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_blocks, speculative=SpeculativeConfig(5, 2, 1))
    for _ in range(2):
        seq = Sequence([1, 2, 3, 4] * 4, SamplingParams(temperature=0, max_tokens=20), 4)
        scheduler.block_manager.allocate(seq)
        seq.num_computed_tokens, seq.status = len(seq) - 1, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    batch = scheduler.schedule()
    assert [len(batch.draft_token_ids.get(i, ())) for i in range(2)] == drafts
    assert batch.num_new_tokens == [1 + d for d in drafts] and scheduler.num_preemptions == 0
    assert all(batch.draft_token_ids[i] == [1, 2, 3, 4][:d] for i, d in enumerate(drafts) if d)


# ---- the config ----

@pytest.mark.parametrize("config, match", [
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead' .value 3"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
    ({"num_speculative_tokens": 2}, "method=None"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "1"}, "prompt_lookup_min='1'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min=3 must be <= prompt_lookup_max=2"),
])
def test_bad_speculative_config_names_the_key_and_value(config, match, qwen3_dir):
    with pytest.raises(ValueError, match=match):
        make_llm(qwen3_dir, config)


def test_speculative_config_defaults_follow_vllm(qwen3_dir):
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        make_llm(qwen3_dir, "ngram")
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert parse_speculative_config(ngram(2, prompt_lookup_min=None)) == SpeculativeConfig(2, 4, 4)
    assert parse_speculative_config(ngram(2, prompt_lookup_max=None, prompt_lookup_min=2)) == \
        SpeculativeConfig(2, 2, 2)


# ---- the verifier ----

def test_verify_drafts_counts_each_sequences_leading_accepted_drafts():
    # Sequences of 3, 1 and 4 rows; drafts (-1 at each last row) against the sampled tokens.
    sampled = torch.tensor([5, 6, 7, 9, 1, 2, 3, 4])
    drafts = torch.tensor([5, 0, -1, -1, 1, 2, 3, -1])
    seq_index = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    offsets = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    assert verify_drafts(sampled, drafts, seq_index, offsets, 3).tolist() == [1, 0, 3]
    # A rejection stops the run even where a later draft matches.
    assert verify_drafts(torch.tensor([4, 5, 6]), torch.tensor([0, 5, -1]), torch.zeros(3, dtype=torch.long),
                         torch.arange(3), 1).tolist() == [0]


def test_rejection_sampler_output_is_distributed_as_the_target():
    """n sequences with one draft d each, the target p the same at every row: a draft is accepted with probability
    p(d), a rejected position emits a token distributed as p without d renormalized, so what the sequence emits at
    the draft's position is distributed as p (5-sigma bounds, fixed keys)."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    d, n = 2, 40_000
    keys = torch.from_numpy(noise_keys(np.arange(n, dtype=np.uint64) * 7919 + 3, np.full(n, 11)))
    rows_keys = torch.stack([keys, keys.flip(0)], 1).reshape(2 * n, 2)  # each sequence's draft row and bonus row
    sampled = exponential_race(p.expand(2 * n, -1).clone(), rows_keys)
    drafts = torch.tensor([d, -1]).repeat(n)
    accepted = verify_drafts(sampled, drafts, torch.arange(n).repeat_interleave(2), torch.tensor([0, 1]).repeat(n), n)
    emitted = sampled.view(n, 2)[:, 0]  # the token at the draft's position: d if accepted, else the correction
    assert torch.equal(accepted == 1, emitted == d)

    def within(freq: torch.Tensor, q: torch.Tensor, count: int) -> bool:
        return bool(((freq - q).abs() <= 5 * (q * (1 - q) / count).sqrt() + 1e-9).all())

    assert within(torch.bincount(emitted, minlength=5) / n, p, n)
    assert within((accepted == 1).float().mean(), p[d], n)
    rejected = emitted[accepted == 0]
    without_d = p.clone()
    without_d[d] = 0
    assert within(torch.bincount(rejected, minlength=5) / len(rejected), without_d / without_d.sum(), len(rejected))


# ---- the engine ----

@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_greedy_with_drafts_equals_plain_and_transformers(kind, model_dir, captured_logits):
    d = model_dir(kind)
    prompts = [CANDIDATES[i] for i in REPETITIVE[kind]]
    refs = cached_hf_greedy(d, prompts, MAX_TOKENS)
    plain = make_llm(d).generate(prompts, GREEDY, use_tqdm=False)
    assert check_against_hf(plain, refs, captured_logits) < 1e-4
    expected = token_ids(plain)
    for k in (1, 3, 5):
        llm = make_llm(d, ngram(k))
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0) if k == 3 else GREEDY
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outputs) == expected, f"k={k}"
        stats = llm.llm_engine.spec_decode_stats
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats
        assert max(map(len, llm.llm_engine.last_batch.draft_token_ids.values()), default=0) <= k
        if k == 3:  # the target's logits, through the chosen tokens' logprobs, against transformers'
            for out, ref in zip(outputs, refs):
                want = ref["logits"].log_softmax(-1).gather(1, torch.tensor(ref["token_ids"])[:, None])[:, 0]
                got = torch.tensor([next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
                assert (got - want).abs().max() < 1e-4


def test_prefix_hit_on_blocks_that_accepted_drafts_filled(qwen3_dir):
    """A prompt extending a drafted completion hits the blocks that accepted drafts filled, and continues exactly as
    a plain run of that prompt (their K/V are the real tokens', whatever rejected drafts wrote there before)."""
    prompt = CANDIDATES[15]
    llm = make_llm(qwen3_dir, ngram(5), kvcache_block_size=8)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens >= 10
    extended = prompt + first[:40]
    again = llm.generate([extended], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(extended) - 1) // 8 * 8 > len(prompt) + 8
    plain = make_llm(qwen3_dir, enable_prefix_caching=False).generate([extended], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_chunked_prefill_preemption_and_prefix_hits_with_drafts(qwen3_dir):
    """A tiny budget (chunks, drafts cut to fit), a tiny cache (preemption; drafts never take the blocks of later
    sequences), shared prefixes, twice: the tokens of a plain run, and drafts were accepted."""
    shared = CANDIDATES[15] + CANDIDATES[6]
    prompts = [shared + CANDIDATES[i] for i in (20, 0, 14)] + [CANDIDATES[i] for i in (15, 6, 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = token_ids(make_llm(qwen3_dir, max_model_len=96).generate(prompts, params, use_tqdm=False))
    llm = make_llm(qwen3_dir, ngram(3), max_model_len=96, kvcache_block_size=8, num_kvcache_blocks=16,
                   max_num_batched_tokens=10)
    for _ in range(2):
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0 and engine.spec_decode_stats.num_accepted_tokens > 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stops_inside_an_accepted_run(qwen3_dir, monkeypatch):
    """max_tokens, stop tokens (with min_tokens) and stop strings that land inside a run of accepted drafts end the
    output exactly where a plain run ends it; nothing after the stop is emitted."""
    prompt = CANDIDATES[15]
    full = make_llm(qwen3_dir).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 30)]
    # min_tokens moves the first stop past the early tokens (and bans stop tokens by position in drafted rows).
    params += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t], min_tokens=m)
               for t in sorted(set(full.token_ids[:20])) for m in (0, 7, 13, 21)]
    params += [SamplingParams(temperature=0, max_tokens=40, stop=[full.text[i:i + 2]], include_stop_str_in_output=s,
                              min_tokens=m) for i in (3, 11) for s in (False, True) for m in (0, 9, 17)]
    prompts = [prompt] * len(params)

    def run(llm: LLM) -> list[tuple]:
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]

    expected = run(make_llm(qwen3_dir))
    spec = make_llm(qwen3_dir, ngram(5))
    # Outputs whose step emitted several tokens: ending on its last one (length), or with tokens left after (stop).
    ends = {"length": 0, "stop": 0}
    append = LLMEngine._append_accepted

    def recording_append(self, seq, tokens, logprobs):
        before = len(seq.token_ids)
        append(self, seq, tokens, logprobs)
        appended = len(seq.token_ids) - before
        if seq.finish_reason == "length" and appended or seq.finish_reason == "stop" and appended < len(tokens):
            ends[seq.finish_reason] += 1

    monkeypatch.setattr(LLMEngine, "_append_accepted", recording_append)
    assert run(spec) == expected
    assert ends["length"] > 3 and ends["stop"] > 3, ends
    assert {e[2] for e in expected} == {"length", "stop"}


def test_logprobs_n_seeds_and_streaming_equal_a_plain_run(qwen3_dir):
    """Random sampling (temperature, top-k, top-p, min-p) with per-request seeds and n = 2, logit_bias,
    allowed_token_ids and logprobs: the samples, logprobs and cumulative logprobs are a plain run's (the verifier
    samples each position with the plain run's noise key); streamed as deltas, the pieces add up to the plain run's
    tokens."""
    prompts = [CANDIDATES[i] for i in (15, 6, 20, 15, 15)]
    params = [SamplingParams(n=2, temperature=0.3, top_k=20, top_p=0.95, seed=5, max_tokens=32, logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.5, min_p=0.05, seed=9, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias={18: 3.0, 296: -2.0}),
              SamplingParams(temperature=0.8, seed=4, max_tokens=32, ignore_eos=True,
                             allowed_token_ids=list(range(0, 512, 3)) + [18, 296])]
    delta = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def run(llm: LLM) -> tuple[list, list[int]]:
        completions = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
        streamed = [t for o in llm.generate_iter([CANDIDATES[15]], delta) for t in o.outputs[0].token_ids]
        return completions, streamed

    plain, spec = make_llm(qwen3_dir), make_llm(qwen3_dir, ngram(3))
    (expected, expected_stream), (got, got_stream) = run(plain), run(spec)
    assert spec.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    assert got_stream == expected_stream and len(got_stream) == 32
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        assert (a.logprobs is None) == (b.logprobs is None) and a.finish_reason == b.finish_reason
        if a.logprobs is None:
            continue
        assert math.isclose(a.cumulative_logprob, b.cumulative_logprob, abs_tol=1e-3)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
            assert max(abs(v.logprob - y[t].logprob) for t, v in x.items()) < 1e-4


def test_seeded_sampling_distribution_equals_a_plain_runs(qwen3_dir):
    """Many seeded samples of one repetitive prompt: with drafts, each sample is the plain run's (same noise key per
    position), so the token distributions match exactly; and drafts were accepted while sampling."""
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=16, ignore_eos=True) for s in range(24)]
    prompts = [CANDIDATES[15]] * len(params)
    expected = token_ids(make_llm(qwen3_dir).generate(prompts, params, use_tqdm=False))
    spec = make_llm(qwen3_dir, ngram(4))
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == expected
    assert len({tuple(t[0]) for t in expected}) > 3  # really sampled: the samples differ
    assert spec.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_unseeded_sampling_distribution_matches_a_plain_runs(qwen3_dir, monkeypatch):
    """Without request seeds, runs with different engine seeds draw different noise. What rejection sampling must
    preserve is how often the sampled token equals the n-gram draft (p(d)): over 300 samples x 12 positions it is the
    same with drafts as without, within sampling noise, while a verifier that accepts every draft inflates it."""
    params = SamplingParams(temperature=0.4, max_tokens=12, ignore_eos=True)
    prompt = CANDIDATES[15]

    def copy_rate(llm: LLM) -> float:
        """The share of positions with an n-gram proposal whose token equals its first draft."""
        hits = trials = 0
        for i, out in enumerate(llm.generate([prompt] * 300, params, use_tqdm=False)):
            tokens, drafter = prompt + out.outputs[0].token_ids, proposer(k=1)
            for t in range(len(prompt), len(tokens)):
                if draft := drafter.propose(i, tokens[:t], 1):
                    hits, trials = hits + (draft[0] == tokens[t]), trials + 1
        return hits / trials

    plain = copy_rate(make_llm(qwen3_dir, seed=0))
    spec_llm = make_llm(qwen3_dir, ngram(3), seed=1)
    spec = copy_rate(spec_llm)
    assert spec_llm.llm_engine.spec_decode_stats.num_accepted_tokens > 40
    assert abs(spec - plain) < 0.04, (spec, plain)

    def accept_every_draft(token_ids, draft_ids, *args):  # emits the drafts themselves, as sampled tokens
        token_ids.copy_(torch.where(draft_ids >= 0, draft_ids, token_ids))
        return verify_drafts(token_ids, draft_ids, *args)

    monkeypatch.setattr(model_runner, "verify_drafts", accept_every_draft)
    wrong = copy_rate(make_llm(qwen3_dir, ngram(3), seed=1))
    assert wrong > plain + 0.1, (wrong, plain)


def test_rows_whose_distribution_depends_on_the_drafts_get_none(qwen3_dir):
    """Penalties, bad words of several tokens and structured outputs: no drafts for such rows; the others in the
    batch still get them, a one-token bad word's too (banned at every position), and every output is a plain run's."""
    prompt = CANDIDATES[15]
    plain_text = make_llm(qwen3_dir).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[plain_text[4:8].strip()]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{1,30}")),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=["ro"])]
    # "..ro" is three tokens ("." twice, "ro"); "ro" alone is one, which the plain run samples.
    assert plain_text[4:8] == "..ro"
    expected = token_ids(make_llm(qwen3_dir).generate([prompt] * len(params), params, use_tqdm=False))
    spec = make_llm(qwen3_dir, ngram(3))
    drafted: set[int] = set()
    schedule = spec.llm_engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        drafted.update(int(batch.seqs[i].request_id.rsplit("-", 1)[-1]) % len(params) for i in batch.draft_token_ids)
        return batch

    spec.llm_engine.scheduler.schedule = recording_schedule
    assert token_ids(spec.generate([prompt] * len(params), params, use_tqdm=False)) == expected
    assert "ro" not in spec.get_tokenizer().decode(expected[-1][0])
    assert drafted == {len(params) - 2, len(params) - 1}  # only the unconstrained row's and the one-token word's


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph-runner"])
def test_steps_with_drafts_keep_the_device_fed_ids_right(graphs, qwen3_dir, monkeypatch):
    """The CUDA path on the CPU: steps without drafts replay the decode graph and feed ids from last_sampled, steps
    with drafts run eagerly; the ids fed after a verified step are the last emitted tokens, and the outputs are a
    plain run's (greedy and seeded, n = 2, preemption)."""
    counts = dict(fed=0, graph=0, drafted_steps=0)
    feed = InputBatch.feed_sampled

    def checked_feed(self, input_ids):
        index, rows = self.host.fed_index[:self.num_fed], self.host.fed_rows[:self.num_fed]
        assert torch.equal(input_ids[index], self.last_sampled[rows])
        counts["fed"] += self.num_fed
        counts["graph"] += self.num_fed * (input_ids.data_ptr() != self.host.input_ids.data_ptr())
        feed(self, input_ids)

    prompts = [CANDIDATES[i] for i in (15, 6, 20)]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)] * 2
    prompts = prompts + prompts[:1]
    kwargs = dict(max_model_len=96, kvcache_block_size=8, num_kvcache_blocks=16, max_num_batched_tokens=32,
                  max_num_seqs=6)
    expected = token_ids(make_llm(qwen3_dir, **kwargs).generate(prompts, params, use_tqdm=False))
    llm = make_llm(qwen3_dir, ngram(3), **kwargs)
    if graphs:
        if not llm.llm_engine.model_runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        capture_recorded_graphs(llm.llm_engine.model_runner)
    monkeypatch.setattr(InputBatch, "feed_sampled", checked_feed)
    step = llm.llm_engine._step

    def counting_step():
        out = step()
        counts["drafted_steps"] += bool(llm.llm_engine.last_batch.draft_token_ids)
        return out

    monkeypatch.setattr(llm.llm_engine, "_step", counting_step)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0 and llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    assert counts["fed"] > 0 and counts["drafted_steps"] > 0 and (counts["graph"] > 0) == graphs, counts


@pytest.mark.slow
def test_tensor_parallel_with_drafts_equals_tp1(qwen3_dir):
    prompts = [CANDIDATES[i] for i in REPETITIVE["qwen3"]]
    expected = token_ids(make_llm(qwen3_dir).generate(prompts, GREEDY, use_tqdm=False))
    with make_llm(qwen3_dir, ngram(3), tensor_parallel_size=2) as llm:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0


def test_lora_requests_with_drafts_equal_a_plain_run(llama_dir, tmp_path):
    """Draft tokens run through their sequence's adapter (the step's LoRA mapping covers every token)."""
    from test_lora import write_adapter

    adapters = [write_adapter(llama_dir, tmp_path / str(i), i, r=4, alpha=8, modules=("q_proj", "v_proj", "down_proj"),
                              seed=i).request for i in (1, 2)]
    prompts = [CANDIDATES[i] for i in REPETITIVE["llama"]]
    loras = [adapters[0], None, adapters[1], adapters[0]]

    def run(spec: dict | None) -> tuple[list, LLM]:
        llm = make_llm(llama_dir, spec, enable_lora=True, max_loras=2, max_lora_rank=4)
        return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)), llm

    expected, _ = run(None)
    got, llm = run(ngram(3))
    assert got == expected and llm.llm_engine.spec_decode_stats.num_draft_tokens > 0


def test_models_with_recurrent_state_get_no_drafts(model_dir):
    """A rejected draft would have advanced the linear-attention state: such models decode as without drafts."""
    d = model_dir(QWEN3_NEXT_KINDS[0])
    prompts = [CANDIDATES[i] for i in (15, 6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = token_ids(make_llm(d).generate(prompts, params, use_tqdm=False))
    llm = make_llm(d, ngram(3))
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.scheduler.proposer is None and llm.llm_engine.spec_decode_stats.num_drafts == 0


@pytest.mark.parametrize("window, soft_cap", [(None, None), (5, None), (None, 20.0)])
def test_cpu_backend_runs_short_query_runs_through_the_decode_kernel(window, soft_cap, monkeypatch):
    """A verification step (sequences of 1 to 4 new tokens at the end of cached contexts) attends as the per-sequence
    SDPA path does, every query row as a decode query over its own prefix."""
    from nanoinfer.layers.attention import cpu

    backend = cpu.CPUAttentionBackend(torch.float32)
    if not backend.decode_kernel:
        pytest.skip("the CPU decode kernel is not built")
    g = torch.Generator().manual_seed(0)
    new, ctx = [4, 1, 3], [21, 9, 16]
    k_cache, v_cache = (torch.randn(12, 8, 2, 16, generator=g) for _ in range(2))
    tables = torch.tensor([[3, 7, 1], [5, 2, -1], [0, 9, -1]], dtype=torch.int32)
    cu_q = torch.tensor([0, 4, 5, 8], dtype=torch.int32)

    def attend(kernel_rows: int) -> torch.Tensor:
        monkeypatch.setattr(cpu, "KERNEL_MAX_QUERY_ROWS", kernel_rows)
        meta = AttentionMetadata(slot_mapping=torch.zeros(8, dtype=torch.int64), block_tables=tables,
                                 context_lens=torch.tensor(ctx, dtype=torch.int32), cu_seqlens_q=cu_q,
                                 cu_seqlens_k=torch.tensor([0, 21, 30, 46], dtype=torch.int32), max_seqlen_q=4,
                                 max_seqlen_k=21, block_size=8, has_cached_prefix=True)
        backend.prepare(meta)
        assert (meta.backend_state.row_context_lens is not None) == (kernel_rows > 0)
        q = torch.randn(sum(new), 4, 16, generator=torch.Generator().manual_seed(1))
        return backend.forward(q, None, None, k_cache, v_cache, meta, 0.25, window, soft_cap)

    torch.testing.assert_close(attend(8), attend(0), atol=1e-5, rtol=1e-5)


def test_verification_never_synchronises_with_the_device():
    """Sampling every drafted position and counting accepted drafts on the meta device, where any host
    synchronisation raises (see tests/test_sampling.py's meta_runner)."""
    from test_sampling import meta_runner

    from nanoinfer.engine.scheduler import ScheduledBatch
    from nanoinfer.engine.sequence import Sequence

    params = [SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 1.5}),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, min_tokens=6, stop_token_ids=[7]),
              SamplingParams(temperature=0.0)]
    seqs = [Sequence([1, 2, 3, 2, 1], p, 4, eos_token_ids=frozenset({0})) for p in params]
    for seq in seqs:
        seq.num_computed_tokens, seq.block_table = len(seq) - 1, [0, 1, 2]
    batch = ScheduledBatch(seqs, [3, 1, 4], samples=[True] * 3, draft_token_ids={0: [2, 3], 2: [2, 3, 1]})
    runner = meta_runner()
    runner.input_batch.prepare(batch, batch.samples)
    expanded = [seqs[0]] * 3 + [seqs[1]] + [seqs[2]] * 4
    out = runner.sample(expanded, torch.empty(8, 97, device="meta"))
    num_accepted, last_tokens, first = runner._verify(batch, [0, 1, 2], out.token_ids)
    assert num_accepted.device.type == last_tokens.device.type == "meta" and num_accepted.shape == (3,)
    assert first.tolist() == [0, 3, 4] and runner.input_batch.sampled_positions.tolist() == [5, 6, 7, 5, 5, 6, 7, 8]
