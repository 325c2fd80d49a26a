"""Async scheduling (async_scheduling=True): each step is scheduled and launched while the previous one runs, its
decode ids fed on the device from the tokens sampled there. On the CPU the launch runs to its end, so these tests
check the bookkeeping: the same tokens, logprobs, prefix hits and finish reasons as a plain run, steps really
scheduled ahead, tokens of sequences that finished (or were aborted) while in flight dropped, no block leaked, and
failures rolled back."""
import random
import time
from types import SimpleNamespace

import pytest
import torch
from cuda_fakes import capture_recorded_graphs, count_replays
from models import random_prompts
from test_errors import assert_idle as idle_blocks
from test_lora import adapters, lora_llm  # noqa: F401 (adapters: a fixture)
from test_random_schedules import assert_same, completions

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.sampling_state import HostTransfer
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence

MAX_MODEL_LEN = 128
STOPS = [202, 139, 21]  # among the first tokens that request 4 of the first test generates, for each kind
ENGINE = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
# Sensitive to its state: one token behind, it lets a fourth letter or a second space through.
GRAMMAR = StructuredOutputsParams(regex=r"[a-z]{1,3}( [a-z]{1,3})*")


def assert_same_outputs(got, want) -> None:
    """The same tokens and finish reasons; logprobs within 1e-4 (steps batch differently: fp32 sums in other
    orders)."""
    assert_same(completions(got), completions(want), "async scheduling against a plain run")


def run_both(path, prompts, params, **config) -> tuple[list, list, LLM]:
    """Completions of a plain engine and of an async one (returned open, for its statistics), same config."""
    with LLM(str(path), **ENGINE, **config) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), **ENGINE, **config, async_scheduling=True)
    return want, llm.generate(prompts, params, use_tqdm=False), llm


def assert_idle(llm: LLM) -> None:
    """Every block and recurrent-state slot free, nothing queued (a step left in flight may still hold rows)."""
    idle_blocks(llm)
    manager = llm.llm_engine.scheduler.block_manager
    # The prefix cache's entries name blocks that still hold their hash (none was reused before its step completed).
    assert all(manager.blocks[block_id].hash == h for h, block_id in manager.hash_to_block.items())
    assert len(manager.free_state_slots) == manager.num_state_slots


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next", "gemma3"])
def test_greedy_and_seeded_sampling_equal_a_plain_run(kind, model_dir):
    """qwen3: plain attention; qwen3-next: recurrent state slots (a finished sequence's slot goes to a waiting one,
    maybe while the finished one's last step is in flight); gemma3: sliding windows. Varied max_tokens (a sequence
    whose pending token is its last is not scheduled ahead), stop token ids (the step after a stop is wasted, its
    token dropped), n > 1 with seeds, logprobs and prompt logprobs."""
    prompts = random_prompts(6, 5, 440, 3, 40, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=1 + 7 * i, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, n=2, seed=5, max_tokens=20, logprobs=2),
               SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=1, logprobs=1, stop_token_ids=STOPS),
               SamplingParams(temperature=1.2, min_p=0.05, max_tokens=25, min_tokens=5, seed=9, ignore_eos=True)]
    want, got, llm = run_both(model_dir(kind), prompts, params, max_num_seqs=4)
    with llm:
        assert_same_outputs(got, want)
        stopped = got[4].outputs[0]  # a step computing its next token was in flight: its logprob is not kept
        assert stopped.finish_reason == "stop" and len(stopped.logprobs) == len(stopped.token_ids)
        for out, ref in zip(got, want):
            assert (out.prompt_logprobs is None) == (ref.prompt_logprobs is None)
            for row, ref_row in zip(out.prompt_logprobs or (), ref.prompt_logprobs or ()):
                assert (row is None) == (ref_row is None)
                if row is not None:
                    assert {t: lp.rank for t, lp in row.items()} == {t: lp.rank for t, lp in ref_row.items()}
                    assert [lp.logprob for lp in row.values()] == pytest.approx(
                        [lp.logprob for lp in ref_row.values()], abs=1e-4)
        assert llm.llm_engine.scheduler.num_steps_ahead > 20
        assert_idle(llm)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
def test_decode_graphs_take_the_ids_fed_on_the_device(kind, model_dir, monkeypatch):
    """Decode steps through the graph runner's static buffers (RecordedGraph: a CUDA graph's semantics on the CPU), as
    on CUDA: a step scheduled ahead gets its input ids from the tokens sampled into the rows, copied into the graph's
    static buffer over the host's placeholders (and, with recurrent state, its slots' indices): the plain run's
    tokens and logprobs, penalties included, with the decode steps replayed."""
    replays = count_replays(monkeypatch)
    prompts = random_prompts(7, 5, 440, 3, 30, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True, logprobs=1) for i in range(3)]
    params += [SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(temperature=0, max_tokens=20, presence_penalty=2.0, ignore_eos=True)]
    runs = []
    for async_scheduling in (False, True):
        with LLM(str(model_dir(kind)), **ENGINE, max_num_seqs=8, async_scheduling=async_scheduling) as llm:
            runner = llm.llm_engine.model_runner
            if not runner.backend.decode_kernel:
                pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
            capture_recorded_graphs(runner)
            replays.clear()
            runs.append(llm.generate(prompts, params, use_tqdm=False))
            assert len(replays) > 10
            assert (llm.llm_engine.scheduler.num_steps_ahead > 10) == async_scheduling
            if async_scheduling:
                assert_idle(llm)
    assert_same_outputs(runs[1], runs[0])


def test_adapters_swapped_while_steps_run_ahead(llama_dir, adapters):
    """Three adapters and the base model over two LoRA slots and three running sequences: adapters are evicted and
    loaded while a step is in flight, and every request gets the plain run's tokens."""
    requests = [a.request for a in adapters("llama")] + [None]
    prompts = random_prompts(10, 5, 440, 3, 30, seed=1)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=5 + 3 * i, ignore_eos=True)
              for i in range(10)]
    loras, runs = [requests[i % 4] for i in range(10)], []
    for async_scheduling in (False, True):
        with lora_llm(llama_dir, max_loras=2, max_num_seqs=3, async_scheduling=async_scheduling) as llm:
            runs.append(llm.generate(prompts, params, use_tqdm=False, lora_request=loras))
            assert (llm.llm_engine.scheduler.num_steps_ahead > 10) == async_scheduling
    assert_same_outputs(runs[1], runs[0])


def test_tensor_parallel_ranks_take_the_ids_fed_on_rank_0(qwen3_dir):
    """TP=2 (spawned worker, gloo): rank 0 alone samples, so the ids a step scheduled ahead is fed on its device go
    to the other rank (Step.fed; without that, the worker embeds the host's placeholders and the test fails). The
    tokens, logprobs and finish reasons of a plain TP=1 run, with penalties, a grammar and stops."""
    prompts = random_prompts(6, 5, 440, 3, 40, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=5 + 5 * i, ignore_eos=True, logprobs=1) for i in range(3)]
    params += [SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=20, ignore_eos=True, presence_penalty=1),
               SamplingParams(temperature=0, max_tokens=20, stop_token_ids=STOPS),
               SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured_outputs=GRAMMAR)]
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(str(qwen3_dir), **ENGINE, tensor_parallel_size=2, async_scheduling=True) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_steps_ahead > 10
    assert_same_outputs(got, want)


def test_prefix_hits_on_generated_blocks_are_kept(qwen3_dir):
    """A block that a pending token fills is committed once the token is known: a prompt that repeats a completion
    gets the same prefix hits as in a plain run, and the same tokens."""
    prompt = list(range(100, 121))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        with LLM(str(qwen3_dir), **ENGINE, kvcache_block_size=4, async_scheduling=async_scheduling) as llm:
            first = llm.generate([prompt], greedy, use_tqdm=False)[0]
            again = prompt + list(first.outputs[0].token_ids)
            second = llm.generate([again], greedy, use_tqdm=False)[0]
            runs.append((first.outputs[0].token_ids, second.outputs[0].token_ids, second.num_cached_tokens))
            # Every step but each generate's first (nothing in flight) and each last token's.
            assert llm.llm_engine.scheduler.num_steps_ahead == (2 * 39 if async_scheduling else 0)
    assert runs[1] == runs[0]
    assert runs[0][2] == (len(prompt) + 40 - 1) // 4 * 4  # every full block but the one holding the last token


def test_chunked_prefill_and_preemption_equal_a_plain_run(qwen3_dir):
    """A step budget that chunks prompts while others decode, and a cache so small that sequences preempt each
    other: no step is scheduled ahead when blocks could run short, and the tokens are the plain run's."""
    prompts = random_prompts(8, 5, 440, 10, 60, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = dict(max_num_batched_tokens=24, kvcache_block_size=4, num_kvcache_blocks=40, max_num_seqs=8)
    want, got, llm = run_both(qwen3_dir, prompts, params, **config)
    with llm:
        assert_same_outputs(got, want)
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.num_steps_ahead > 0
        assert_idle(llm)


def test_penalties_count_tokens_in_flight(model_dir):
    """Penalties count each sampled token on the device: steps are scheduled ahead of a penalized sequence's tokens,
    which are penalized before the host knows them, as in a plain run. Gemma 3's random model repeats its last
    token when greedy: a penalty missing the token in flight lets it repeat, and the test fail."""
    prompts = random_prompts(4, 5, 440, 5, 30, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=20, presence_penalty=2.0, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.0, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5)]
    want, got, llm = run_both(model_dir("gemma3"), prompts, params)
    with llm:
        assert_same_outputs(got, want)
        assert llm.llm_engine.scheduler.num_steps_ahead > 10


# "in" (265; after a space, 290), "The" (327) and "5" (25) are one token each, and 265, 327 and 25 are among the tokens
# the prompts below sample without bans.
ONE_TOKEN_BAD_WORDS, BANNED = ["in", "The", "5"], {265, 290, 327, 25}
RO_PROMPT = random_prompts(40, 5, 440, 2, 24, seed=11)[15]  # greedy: "\ufffd.ro..ro.ro nds...", "..ro" 3 tokens


@pytest.mark.parametrize("constraint", [
    dict(bad_words=["..ro", " between"]),
    dict(structured_outputs=GRAMMAR)])
def test_bad_words_and_grammars_read_the_token_in_flight(qwen3_dir, constraint):
    """Bad words of several tokens and structured outputs depend on the generated tokens: a step scheduled ahead of
    such a sequence reads its token in flight before sampling (bans and bitmask one token behind let "ro" follow
    "..", and a fourth letter or a second space through: the test fails), and gives the plain run's tokens."""
    prompts = [*random_prompts(3, 5, 440, 5, 30, seed=4), RO_PROMPT]  # the last one's greedy output has "..ro"
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, **constraint) for i in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **constraint))
    want, got, llm = run_both(qwen3_dir, prompts, params)
    with llm:
        assert_same_outputs(got, want)
        assert llm.llm_engine.scheduler.num_steps_ahead > 10


def test_one_token_bad_words_are_banned_in_steps_scheduled_ahead(qwen3_dir):
    """A one-token bad word is banned whatever the generated tokens: steps run ahead, and none is sampled."""
    prompts = random_prompts(3, 5, 440, 5, 30, seed=4)
    params = dict(temperature=0.8, seed=3, max_tokens=20)
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        free = plain.generate(prompts, SamplingParams(**params), use_tqdm=False)
    assert {265, 327, 25} <= {t for out in free for t in out.outputs[0].token_ids}
    want, got, llm = run_both(qwen3_dir, prompts, SamplingParams(**params, bad_words=ONE_TOKEN_BAD_WORDS))
    with llm:
        assert_same_outputs(got, want)
        assert not BANNED & {t for out in got for t in out.outputs[0].token_ids}
        assert llm.llm_engine.scheduler.num_steps_ahead > 10


def test_aborted_and_finished_sequences_drop_their_tokens_in_flight(qwen3_dir):
    """Through the step API: a request aborted while a step that computes it is in flight gets no more tokens, the
    others are the plain run's, and once all are done every block is free."""
    prompts = random_prompts(4, 5, 440, 5, 30, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = {f"r{i}": tuple(o.outputs[0].token_ids)
                for i, o in enumerate(plain.generate(prompts, params, use_tqdm=False))}
    with LLM(str(qwen3_dir), **ENGINE, async_scheduling=True) as llm:
        engine, done, step = llm.llm_engine, {}, 0
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
            step += 1
            if step == 5:
                assert engine.in_flight is not None and len(engine.in_flight.batch.seqs) == 4
                engine.abort_request("r1")
        assert "r1" not in done and {rid: tuple(c.token_ids) for rid, c in done.items()} == {
            rid: tokens for rid, tokens in want.items() if rid != "r1"}
        assert all(c.finish_reason == "length" for c in done.values())
        assert_idle(llm)


def test_prefix_cache_resets_after_a_generate_that_stopped(qwen3_dir):
    """A generate whose requests all stopped (a stop id) leaves the step launched ahead for them in flight; no request
    holds blocks, so reset_prefix_cache() completes that step and forgets the cache."""
    with LLM(str(qwen3_dir), **ENGINE, async_scheduling=True) as llm:
        greedy = dict(temperature=0, max_tokens=20)
        stop = llm.generate([[5, 6, 7, 8]], SamplingParams(**greedy, ignore_eos=True), use_tqdm=False)[0]
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(**greedy, stop_token_ids=[stop.outputs[0].token_ids[5]]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and llm.llm_engine.in_flight is not None
        assert llm.reset_prefix_cache() is True
        assert_idle(llm)


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_step_rolls_back_both_steps(qwen3_dir, monkeypatch, where):
    """A step that fails (its launch, scheduled ahead, or the collection of the one before it) leaves nothing in
    flight: the next generate recomputes every sequence and gives the plain run's tokens."""
    prompts = random_prompts(3, 5, 440, 5, 30, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(qwen3_dir), **ENGINE, async_scheduling=True, kvcache_block_size=4) as llm:
        want = completions(llm.generate(prompts, params, use_tqdm=False))
        real, calls = getattr(ModelRunner, where), []

        def failing(self, arg):
            calls.append(1)
            if len(calls) == 6:
                raise RuntimeError("simulated failure")
            return real(self, arg)

        monkeypatch.setattr(ModelRunner, where, failing)
        with pytest.raises(RuntimeError, match="simulated failure"):
            llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.undo()
        assert llm.llm_engine.in_flight is None
        assert completions(llm.generate(prompts, params, use_tqdm=False)) == want
        assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_failing_after_sampling_leaves_no_stale_penalty_count(model_dir, monkeypatch, async_scheduling):
    """Through the step API, which goes on after a failed step: a step whose tokens were sampled (and counted for
    penalties on the device) but never appended is rolled back, and the sequences' counts are rebuilt from their
    tokens: the completions are a plain run's. Gemma 3's greedy random model repeats its last token, which a stale
    presence penalty would steer it away from."""
    prompts = random_prompts(3, 5, 440, 5, 30, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=2.0, ignore_eos=True)
    path = str(model_dir("gemma3"))
    with LLM(path, **ENGINE) as plain:
        want = [tuple(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **ENGINE, async_scheduling=async_scheduling) as llm:
        engine, done, calls = llm.llm_engine, {}, []
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        collect = ModelRunner.collect

        def failing_collect(self, launched):
            calls.append(1)
            if len(calls) == 6:
                raise RuntimeError("simulated failure")
            return collect(self, launched)

        monkeypatch.setattr(ModelRunner, "collect", failing_collect)
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except RuntimeError as e:
                assert "simulated failure" in str(e)
                continue
            done.update((o.request_id, tuple(o.outputs[0].token_ids)) for o in outputs if o.finished)
        assert len(calls) > 6 and [done[str(i)] for i in range(len(prompts))] == want


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_step_api_sessions_equal_a_plain_run(qwen3_dir, monkeypatch, seed, async_scheduling):
    """The step API driven at random: requests arrive between steps (greedy and seeded, some penalized, some with stop
    ids, some with bad words of two tokens or a grammar), others are aborted, and launches and collections fail
    now and then (the caller goes on). Every request that finishes gets a plain run's tokens, and at the end
    every block is free."""
    rng = random.Random(seed)
    prompts = random_prompts(12, 5, 440, 3, 50, seed=seed)
    params = [SamplingParams(max_tokens=rng.randint(1, 30), seed=i, stop_token_ids=rng.choice([[], STOPS]),
                             temperature=rng.choice([0, 0.8]), frequency_penalty=rng.choice([0, 0, 0.5]),
                             bad_words=rng.choice([None, None, [".."]]),
                             structured_outputs=rng.choice([None, None, None, GRAMMAR]))
              for i in range(len(prompts))]
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = {str(i): tuple(o.outputs[0].token_ids)
                for i, o in enumerate(plain.generate(prompts, params, use_tqdm=False))}
    config = dict(kvcache_block_size=4, num_kvcache_blocks=40, max_num_seqs=6, max_num_batched_tokens=32)
    with LLM(str(qwen3_dir), **ENGINE, **config, async_scheduling=async_scheduling) as llm:
        engine, done, aborted, failures = llm.llm_engine, {}, set(), [0]
        for where in ("launch", "collect"):
            real = getattr(ModelRunner, where)

            def failing(self, arg, real=real):
                if rng.random() < 0.04:
                    failures[0] += 1
                    raise RuntimeError("simulated failure")
                return real(self, arg)

            monkeypatch.setattr(ModelRunner, where, failing)
        arrivals = sorted(rng.randrange(40) for _ in prompts)
        step = 0
        while step < 40 or engine.has_unfinished_requests():
            for i, at in enumerate(arrivals):
                if at == step:
                    engine.add_request(str(i), prompts[i], params[i])
            if engine.has_unfinished_requests() and rng.random() < 0.05:
                victim = rng.choice(list(engine.requests))
                engine.abort_request(victim)
                aborted.add(victim)
            try:
                outputs = engine.step()
            except RuntimeError as e:
                assert "simulated failure" in str(e)
                outputs = []
            done.update((o.request_id, tuple(o.outputs[0].token_ids)) for o in outputs if o.finished)
            step += 1
        assert failures[0] > 0 and aborted and (engine.scheduler.num_steps_ahead > 20) == async_scheduling
        assert done == {rid: tokens for rid, tokens in want.items() if rid not in aborted}
        assert_idle(llm)


def test_schedule_ahead_only_beside_one_step_in_flight():
    """schedule(ahead=True) runs beside exactly one step in flight, skips a sequence whose pending token is its last,
    and never preempts: None when the free blocks could not give every running sequence its next token."""
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=4,
                             enable_prefix_caching=True, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=5)
    assert scheduler.schedule(ahead=True) is None  # nothing in flight
    a = Sequence([1, 2, 3], SamplingParams(), 4, max_tokens=1)
    b = Sequence([4, 5, 6, 7, 8, 9], SamplingParams(), 4, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert first.starts == [0, 0] and first.samples == [True, True]
    assert (a.num_computed_tokens, a.num_pending_tokens, b.num_computed_tokens, b.num_pending_tokens) == (3, 1, 6, 1)
    ahead = scheduler.schedule(ahead=True)
    assert ahead.seqs == [b] and ahead.starts == [6] and ahead.num_new_tokens == [1]  # a's pending token is its last
    assert (b.num_computed_tokens, b.num_pending_tokens, len(b.block_table)) == (7, 2, 2)
    assert scheduler.schedule(ahead=True) is None  # two in flight already
    assert scheduler.postprocess(first, [50, 60]) == [a, b] and b.token_ids[-1] == 60 and b.num_pending_tokens == 1
    scheduler.finish(a)
    assert scheduler.postprocess(ahead, [70]) == [b] and b.token_ids[-2:] == [60, 70] and b.num_pending_tokens == 0
    assert scheduler.schedule(ahead=True) is None  # nothing in flight

    tight = Scheduler(config, num_kvcache_blocks=3)
    x, y = (Sequence([1, 2, 3, 4], SamplingParams(), 4, max_tokens=8) for _ in range(2))
    tight.add(x)
    tight.add(y)
    tight.schedule()  # one block each; their pending tokens need one more each, and one is free
    assert tight.schedule(ahead=True) is None and tight.num_preemptions == 0 and tight.num_steps_ahead == 0


def test_a_block_committed_while_in_flight_and_reused_leaves_no_stale_cache_entry():
    """A pending token that fills a block commits it when it arrives; if its sequence stops then, the block is freed
    and may be taken by a step scheduled ahead before the step writing it completes. The commit must go with the
    block: a published entry naming a reused block would keep that prefix out of the cache for good."""
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=4,
                             enable_prefix_caching=True, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=2)
    manager = scheduler.block_manager
    a = Sequence([1, 2, 3], SamplingParams(), 4, max_tokens=8)
    scheduler.add(a)
    first = scheduler.schedule()
    ahead = scheduler.schedule(ahead=True)  # computes a's pending token, the fourth: block 0 is full
    assert ahead.seqs == [a] and a.block_table == [0]
    scheduler.postprocess(first, [4])
    assert manager.step_hash_to_block  # committed now that its last token is known
    scheduler.finish(a)  # a stop at its first token: block 0 is free (and block 1 was never used)
    scheduler.add(Sequence([7, 8, 9, 10, 11], SamplingParams(), 4, max_tokens=2))
    again = scheduler.schedule(ahead=True)  # the new sequence takes both blocks
    assert sorted(again.seqs[0].block_table) == [0, 1]
    scheduler.postprocess(ahead, [5])
    assert all(manager.blocks[block_id].hash == h for h, block_id in manager.hash_to_block.items())


def test_results_of_a_step_launched_ahead_go_to_the_other_buffer(monkeypatch):
    """HostTransfer's CUDA branch with CPU stand-ins (a plain tensor for pinned memory, an event that is always
    done; the copies run at once): the results of the step launched ahead do not overwrite those of the step in
    flight before they are read, and a third step reuses the first one's buffer."""
    class DoneEvent:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", DoneEvent)
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    transfer = HostTransfer(torch.device("cuda"))
    steps = [[torch.tensor([3, 1 + i]), torch.full((2, 2), 0.5 * i)] for i in range(3)]
    first, second = transfer.start(steps[0]), transfer.start(steps[1])
    for results, tensors in ((first, steps[0]), (second, steps[1])):
        got = results.wait()
        assert [(t.dtype, t.tolist()) for t in got] == [(t.dtype, t.tolist()) for t in tensors]
    third = transfer.start(steps[2])
    assert third.host.data_ptr() == first.host.data_ptr() != second.host.data_ptr()
    assert third.wait()[1].tolist() == steps[2][1].tolist()


def test_async_scheduling_is_checked(qwen3_dir):
    with pytest.raises(TypeError, match="async_scheduling must be a bool, got 'yes'"):
        LLM(str(qwen3_dir), **ENGINE, async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling=True cannot be combined with speculative_config"):
        LLM(str(qwen3_dir), **ENGINE, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_scheduling_on_cuda_equals_a_plain_run(qwen3_dir):
    """On CUDA, with decode graphs (the fed ids land in a graph's static buffer): the same tokens and logprobs."""
    prompts = random_prompts(8, 5, 440, 5, 60, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=30 + i, ignore_eos=True, logprobs=1) for i in range(4)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=30, top_k=10) for i in range(4)]
    cuda = dict(device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN, attention_backend="triton",
                num_kvcache_blocks=256)
    with LLM(str(qwen3_dir), **cuda) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(str(qwen3_dir), **cuda, async_scheduling=True) as llm:
        assert llm.llm_engine.model_runner.graph_runner is not None
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_steps_ahead > 20
    assert_same_outputs(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_launched_ahead_never_waits_for_the_device(qwen3_dir):
    """With the device kept busy (a sleep kernel queued after step N completes), step() launches step N+1 behind it
    and returns step N's outputs at once: neither the launch (uploads, graph replay, greedy and random sampling with
    top-p alone, top-k, min-p, min_tokens and logprobs, the copy to pinned memory) nor the collection waits for the
    device beyond step N's own results."""
    with LLM(str(qwen3_dir), device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN, attention_backend="triton",
             num_kvcache_blocks=64, async_scheduling=True) as llm:
        engine = llm.llm_engine
        for i, params in enumerate([dict(temperature=0), dict(temperature=0.6, top_p=0.9, logprobs=2),
                                    dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, min_tokens=8,
                                         stop_token_ids=[3])]):  # min_tokens bans token 3: the ban path runs
            engine.add_request(f"r{i}", [5, 6, 7, 8 + i],
                               SamplingParams(**params, max_tokens=20, ignore_eos=True, seed=i))
        for _ in range(3):
            engine.step()
        assert engine.in_flight is not None and engine.model_runner.graph_runner is not None
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(2_000_000_000)  # about a second at an H100's clocks
        outputs = engine.step()
        returned = time.perf_counter() - start
        torch.cuda.synchronize()
        slept = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]
        assert slept > 0.3 and returned < slept / 4, (returned, slept)
