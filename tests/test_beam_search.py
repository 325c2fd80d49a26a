"""LLM.beam_search (vLLM's interface and semantics): against transformers' beam search where the two are defined
the same way, against vLLM's algorithm written out on transformers' logits where they differ (EOS, the length
rule), greedy at beam_width=1, prompt forms, bad input and failed steps leaving the engine usable."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from models import cached_hf_greedy, hf_forward_logits, load_hf_model, random_prompts
from nanoinfer import LLM, BeamSearchParams, SamplingParams
from nanoinfer.beam_search import BeamSearchOutput, get_beam_search_score
from nanoinfer.engine.model_runner import ModelRunner
from test_errors import assert_idle

ATOL = 1e-4
WIDTH, STEPS = 4, 8
# Random token-id prompts; on each of them the best beam differs from greedy on both models (asserted below).
PROMPTS = [random_prompts(6, 5, 448, 3, 12, seed=1)[i] for i in (2, 3, 5)]
EOS = 311  # a token the qwen3 test model's beams often pick: as its EOS, beams end in it (see eos_llm)


def make_llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=8)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return make_llm(qwen3_dir)


@pytest.fixture(scope="module")
def eos_llm(qwen3_dir, tmp_path_factory):
    """The qwen3 test model with EOS = 311 in its generation config: its real EOS, id 0, is never among the
    candidates of a step on PROMPTS."""
    model_dir = tmp_path_factory.mktemp("beam_search") / "qwen3-eos311"
    shutil.copytree(qwen3_dir, model_dir)
    config_path = model_dir / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "eos_token_id": EOS}))
    return make_llm(model_dir)


Beams = list[tuple[list[int], float]]  # one prompt's beams, best first: (prompt + completion ids, cum_logprob)


def beams_of(outputs: list[BeamSearchOutput]) -> list[Beams]:
    return [[(s.tokens, s.cum_logprob) for s in output.sequences] for output in outputs]


def assert_same_beams(ours: list[Beams], ref: list[Beams]) -> None:
    """Per prompt: the same token ids in the same order, cumulative logprobs within ATOL."""
    assert len(ours) == len(ref)
    for mine, theirs in zip(ours, ref):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [c for _, c in mine] == pytest.approx([c for _, c in theirs], abs=ATOL)


@torch.inference_mode()
def hf_beam_search(model_dir, prompt: list[int], length_penalty: float) -> Beams:
    """transformers' beams, best first, with their cumulative logprobs (sequences_scores is cum / STEPS ** lp: its
    length counts the generated tokens, and without EOS every beam runs STEPS tokens)."""
    out = load_hf_model(model_dir).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        num_beams=WIDTH, num_return_sequences=WIDTH, max_new_tokens=STEPS, length_penalty=length_penalty,
        eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    return [(seq, score * STEPS ** length_penalty)
            for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist())]


@pytest.mark.parametrize("kind,length_penalty", [("qwen3", 1.0), ("llama", 0.0)])
def test_matches_transformers_beam_search(model_dir, kind, length_penalty):
    """Compared: each prompt's beams (prompt + completion ids, best first) and cumulative logprobs against
    transformers' `generate(num_beams=W, num_return_sequences=W, do_sample=False, eos_token_id=None)` returned
    sequences and sequences_scores (times STEPS ** length_penalty), all prompts in one beam_search call.

    Why they are comparable: with ignore_eos=True here and eos_token_id=None there, neither search sets a beam
    aside, and both keep, each step, the W best (beam, token) pairs: transformers from the top 2W over all beams by
    cumulative logprob, vLLM from each beam's top 2W (the W best pairs are among them) by cum / length ** lp, and
    every live beam has the same length. Except in one case: vLLM's length leaves out a final EOS even under
    ignore_eos, so with lp != 0 a live beam ending in EOS ranks lower than transformers ranks it. On llama one does
    (EOS 0 is among a step's W best on PROMPTS[1]), hence lp = 0 there; on qwen3 EOS is never even a candidate,
    so lp = 1 is compared.
    Both end after STEPS tokens with W beams, so the final ranking (vLLM's length counts the prompt, transformers'
    only the completion) and early_stopping do not matter. With EOS in play the searches differ: see
    test_eos_as_in_vllm."""
    model_dir = model_dir(kind)
    llm = make_llm(model_dir)
    eos = llm.llm_engine.eos_token_ids
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(WIDTH, STEPS, ignore_eos=True,
                                                        length_penalty=length_penalty))
    greedy = cached_hf_greedy(model_dir, PROMPTS, STEPS)
    assert_same_beams(beams_of(outputs), [hf_beam_search(model_dir, p, length_penalty) for p in PROMPTS])
    for prompt, output, ref in zip(PROMPTS, outputs, greedy):
        assert output.sequences[0].tokens != prompt + ref["token_ids"], "beam search must differ from greedy"
        assert not any(s.tokens[-1] in eos for s in output.sequences)
        for s in output.sequences:
            assert s.finish_reason == "length" and s.text == llm.tokenizer.decode(s.tokens)
            assert len(s.logprobs) == STEPS and all(len(step) == 2 * WIDTH for step in s.logprobs)
            assert s.cum_logprob == pytest.approx(sum(step[t].logprob for step, t in
                                                      zip(s.logprobs, s.tokens[len(prompt):])), abs=1e-9)
    assert_idle(llm)


def vllm_beam_search(model_dir, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> Beams:
    """vLLM's LLM.beam_search written out on transformers' logits (a whole forward per beam): each beam's top 2W
    tokens are its candidates; those ending in EOS are set aside (unless ignore_eos), whatever their rank; the W
    best of the others by vLLM's score go on; at the end the W best of both by that score."""
    def score(beam):  # written out again, not get_beam_search_score: a reference of its own
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in eos)) ** params.length_penalty

    beams, completed = [(prompt, 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in beams:
            top = F.log_softmax(hf_forward_logits(model_dir, tokens)[-1], dim=-1).topk(2 * params.beam_width)
            candidates += [(tokens + [t], cum + lp) for lp, t in zip(top.values.tolist(), top.indices.tolist())]
        stop = set() if params.ignore_eos else eos
        completed += [c for c in candidates if c[0][-1] in stop]
        beams = sorted((c for c in candidates if c[0][-1] not in stop), key=score, reverse=True)[:params.beam_width]
    return sorted(completed + beams, key=score, reverse=True)[:params.beam_width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_eos_as_in_vllm(eos_llm, qwen3_dir, length_penalty):
    """With EOS among the candidates, vLLM's search is not transformers': a candidate ending in EOS is completed
    whatever its rank among its beam's top 2W (transformers: only within the step's top W, at most W kept, and an
    early stop), and the final rank divides by (prompt + completion - final EOS) ** lp (transformers: completion,
    EOS included). So the reference is vLLM's algorithm on transformers' logits. Beams ending in EOS are kept,
    with finish_reason "stop", beside beams that ran max_tokens ("length"). With ignore_eos every beam runs
    max_tokens, yet a live beam ending in EOS still ranks by the shorter length (which changes the beams at
    lp = 1 here)."""
    params = BeamSearchParams(WIDTH, STEPS, length_penalty=length_penalty)
    outputs = eos_llm.beam_search(PROMPTS, params)
    assert_same_beams(beams_of(outputs), [vllm_beam_search(qwen3_dir, p, params, {EOS}) for p in PROMPTS])
    reasons = set()
    for prompt, output in zip(PROMPTS, outputs):
        for s in output.sequences:
            assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length") and s.stop_reason is None
            assert len(s.tokens) == len(prompt) + STEPS or s.finish_reason == "stop"
            reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"}
    params = BeamSearchParams(WIDTH, STEPS, ignore_eos=True, length_penalty=length_penalty)
    ignored = eos_llm.beam_search(PROMPTS, params)
    assert_same_beams(beams_of(ignored), [vllm_beam_search(qwen3_dir, p, params, {EOS}) for p in PROMPTS])
    assert all(len(s.tokens) == len(p) + STEPS for p, o in zip(PROMPTS, ignored) for s in o.sequences)
    assert beams_of(ignored) != beams_of(outputs)
    assert_idle(eos_llm)


def test_score_counts_prompt_and_not_final_eos():
    assert get_beam_search_score([1, 2, 3, 4], -6.0, {4}, 1.0) == -2.0
    assert get_beam_search_score([1, 2, 3, 4], -6.0, {9}, 0.5) == -3.0
    assert get_beam_search_score([1, 2, 3, 4], -6.0, {9}, 0.0) == -6.0


def test_width_1_is_greedy(llm):
    """Tokens and cumulative logprob of greedy generate. Only with ignore_eos: otherwise vLLM's search sets an EOS
    argmax aside and goes on with the runner-up, where greedy stops."""
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(1, STEPS, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    for prompt, output, ref in zip(PROMPTS, outputs, greedy):
        (beam,) = output.sequences
        assert beam.tokens == prompt + ref.outputs[0].token_ids
        assert beam.cum_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=ATOL)
    assert_idle(llm)


def test_temperature_only_adds_the_sampled_candidate(llm):
    """As in vLLM, temperature > 0 samples each beam's one token, which joins its step's candidates beside the top
    2W when it is not among them; such a candidate ranks below 2W others of its beam, so without EOS the beams stay
    those of temperature 0."""
    cold = llm.beam_search(PROMPTS, BeamSearchParams(WIDTH, STEPS, ignore_eos=True))
    hot = llm.beam_search(PROMPTS, BeamSearchParams(WIDTH, STEPS, ignore_eos=True, temperature=5.0))
    assert_same_beams(beams_of(hot), beams_of(cold))
    sizes = {len(step) for output in hot for s in output.sequences for step in s.logprobs}
    assert sizes == {2 * WIDTH, 2 * WIDTH + 1}
    assert_idle(llm)


def test_prompt_forms_and_concurrency_limit(llm):
    """Text, token ids and prompt dicts as generate takes them, each with its own result, whatever the
    concurrency_limit (prompts searched at a time); one prompt alone gives a list of one."""
    text = "def add(a, b): return a + b"
    ids = llm.tokenizer.encode(text)
    prompts = [text, PROMPTS[0], {"prompt_token_ids": ids}, {"prompt": text}, PROMPTS[1]]
    params = BeamSearchParams(3, 5)
    expected = beams_of(llm.beam_search([ids, PROMPTS[0], ids, ids, PROMPTS[1]], params))
    assert expected[0] != expected[1] != expected[4]
    for limit in (None, 1, 2):
        assert_same_beams(beams_of(llm.beam_search(prompts, params, concurrency_limit=limit)), expected)
    (alone,) = llm.beam_search(text, params)
    assert_same_beams(beams_of([alone]), expected[:1])
    assert alone.sequences[0].text == llm.tokenizer.decode(alone.sequences[0].tokens)
    assert alone.sequences[0].text.startswith(text)
    assert_idle(llm)


BAD_PARAMS = [
    (dict(beam_width=0, max_tokens=4), ValueError, "beam_width must be >= 1, got 0"),
    (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width must be an int, got 2.0"),
    (dict(beam_width=2, max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
    (dict(beam_width=2, max_tokens=None), TypeError, "max_tokens must be an int, got None"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), TypeError, "ignore_eos must be a bool, got 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), ValueError, "length_penalty must be finite"),
    (dict(beam_width=2, max_tokens=4, length_penalty="1"), TypeError, "length_penalty must be a number"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_PARAMS)
def test_bad_params(kwargs, error, message):
    with pytest.raises(error, match=message):
        BeamSearchParams(**kwargs)


def test_bad_calls_leave_the_engine_usable(llm):
    params = BeamSearchParams(WIDTH, STEPS)
    expected = beams_of(llm.beam_search(PROMPTS, params))
    changed = BeamSearchParams(WIDTH, STEPS)
    changed.beam_width = 0  # after construction: caught when the search starts
    bad_calls = [
        ((PROMPTS, SamplingParams()), TypeError, "params must be BeamSearchParams, got SamplingParams"),
        ((PROMPTS, changed), ValueError, "beam_width must be >= 1, got 0"),
        ((PROMPTS, BeamSearchParams(257, 4)), ValueError, "beam_width=257: 2 \\* beam_width .* vocabulary size 512"),
        ((PROMPTS, BeamSearchParams(2, 123)), ValueError,
         f"prompt of {len(PROMPTS[0])} tokens \\+ max_tokens=123 exceeds max_model_len=128"),
        (([PROMPTS[0], []], params), ValueError, "prompt is empty"),
        (([PROMPTS[0], [1, 512]], params), ValueError, "token id 512 is outside the vocabulary"),
        ((b"abc", params), TypeError, "prompts must be a string, a list of token ids"),
    ]
    for args, error, message in bad_calls:
        with pytest.raises(error, match=message):
            llm.beam_search(*args)
    with pytest.raises(ValueError, match="concurrency_limit must be None or >= 1, got 0"):
        llm.beam_search(PROMPTS, params, concurrency_limit=0)
    assert_idle(llm)
    assert_same_beams(beams_of(llm.beam_search(PROMPTS, params)), expected)


def test_failed_step_frees_everything(llm, monkeypatch):
    """A step failing mid-search (here the third) propagates; the beams' requests are aborted, no KV block stays
    held, and the next search gives what it gave before."""
    params = BeamSearchParams(WIDTH, STEPS)
    expected = beams_of(llm.beam_search(PROMPTS, params))
    run, calls = ModelRunner.launch, []

    def failing_run(self, batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return run(self, batch)

    monkeypatch.setattr(ModelRunner, "launch", failing_run)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.beam_search(PROMPTS, params)
    assert calls[-1] > 1  # it failed with several beams in flight
    assert_idle(llm)
    assert not llm.llm_engine.has_unfinished_requests()
    monkeypatch.setattr(ModelRunner, "launch", run)
    assert_same_beams(beams_of(llm.beam_search(PROMPTS, params)), expected)
    assert_idle(llm)
