"""Prompts given as embeddings (LLM(enable_prompt_embeds=True), {"prompt_embeds": [tokens, hidden]}), vLLM's
EmbedsPrompt: for every family that takes them, the embeddings transformers' get_input_embeddings() gives for some
token ids generate what those ids do (tokens and logprobs); through chunked prefill, preemption, n > 1, async
scheduling, decode graphs, tensor parallelism and truncation; never in the prefix cache; bad input and the families
that cannot take them refused by name."""
import json

import pytest
import torch
import transformers
from cuda_fakes import capture_recorded_graphs
from models import ALL_KINDS, ODD_KIND, load_hf_model, random_prompts
from test_random_schedules import assert_same, completions

from nanoinfer import LLM, BeamSearchParams, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128)
PROMPTS = random_prompts(3, 5, 440, 5, 40, seed=31) + [[17]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
# Their token ids go past their embedding: DeepSeek-V4's class says why (prompt_embeds_refused), the others have more
# than one embedding.
REFUSED = {"deepseek-v4", "gemma4-e", "gemma3n", "qwen4-exp"}


def embedded(model_dir, prompts: list[list[int]]) -> list[dict]:
    """The prompts as transformers' input embeddings of their ids."""
    embedding = load_hf_model(model_dir).get_input_embeddings()
    if model_dir.name == "inkling" and not hasattr(embedding, "embed_norm"):
        pytest.skip(f"transformers {transformers.__version__}'s Inkling keeps the embedding's norm out of its input "
                    f"embedding (5.23's and later, and the engine, norm inside it)")
    with torch.no_grad():
        return [{"prompt_embeds": embedding(torch.tensor(p)).float()} for p in prompts]


@pytest.mark.parametrize("kind", [*ALL_KINDS, ODD_KIND])
def test_embeddings_of_token_ids_generate_what_the_ids_do(kind, model_dir):
    d = model_dir(kind)
    if kind in REFUSED:
        architecture = json.loads((d / "config.json").read_text())["architectures"][0]
        with pytest.raises(ValueError, match=f"enable_prompt_embeds: {architecture} .* takes no prompt embeddings: "):
            LLM(str(d), **ENGINE, enable_prompt_embeds=True)
        return
    with LLM(str(d), **ENGINE, enable_prompt_embeds=True) as llm:
        want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = llm.generate(embedded(d, PROMPTS), GREEDY, use_tqdm=False)
    assert_same(completions(got), completions(want), f"{kind}: prompt embeddings against their token ids")
    assert all(o.prompt_token_ids is None and o.prompt is None for o in got)


def test_prompt_embeds_through_chunks_preemption_n_async_and_truncation(qwen3_dir):
    """Embedded and plain prompts in one batch, under a 16-token budget and a 12-block cache (chunked prefill,
    preemption), n = 2 with seeds, async scheduling, truncate_prompt_tokens: the tokens of the ids alone."""
    prompts = random_prompts(6, 5, 440, 10, 60, seed=32)
    params = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True, logprobs=1) for i in range(3)]
    params += [SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(2)]
    params += [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=7)]
    inputs = [e if i % 2 else p for i, (p, e) in enumerate(zip(prompts, embedded(qwen3_dir, prompts)))]
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    for async_scheduling in (False, True):
        with LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=True, max_num_batched_tokens=16,
                 num_kvcache_blocks=12, async_scheduling=async_scheduling) as llm:
            got = llm.generate(inputs, params, use_tqdm=False)
            assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_same(completions(got), completions(want), f"async_scheduling={async_scheduling}")


def test_one_token_prompts_of_embeddings_skip_the_decode_graphs(qwen3_dir):
    """A one-token prompt makes a decode-shaped step, which a graph would run without the embeddings."""
    prompts = [[17], [230], [99]]
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=True) as llm:
        runner = llm.llm_engine.model_runner
        if not runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        capture_recorded_graphs(runner)
        got = llm.generate(embedded(qwen3_dir, prompts), GREEDY, use_tqdm=False)
    assert_same(completions(got), completions(want), "one-token prompts of embeddings with decode graphs")


def test_tensor_parallel_ranks_take_the_embeddings(qwen3_dir):
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=True, tensor_parallel_size=2) as llm:
        got = llm.generate(embedded(qwen3_dir, PROMPTS), GREEDY, use_tqdm=False)
    assert_same(completions(got), completions(want), "prompt embeddings with TP=2")


def test_prompt_embeds_stay_out_of_the_prefix_cache_and_the_prompt_penalty(qwen3_dir):
    """Their token ids are placeholders (0): no cache hit either way, and token 0 is no prompt token to a repetition
    penalty."""
    prompt = random_prompts(1, 5, 440, 40, 40, seed=33)[0]
    embeds = embedded(qwen3_dir, [prompt])[0]
    with LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=True) as llm:
        first, again = (llm.generate(embeds, GREEDY, use_tqdm=False)[0] for _ in range(2))
        assert first.num_cached_tokens == again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        zeros = llm.generate([[0] * 40], GREEDY, use_tqdm=False)[0]
        assert zeros.num_cached_tokens == 0
        engine = llm.llm_engine
        engine.add_request("penalized", embeds, SamplingParams(repetition_penalty=2.0, max_tokens=3))
        engine.step()
        cache = engine.model_runner.penalty_cache
        seq = engine.requests["penalized"][0]
        assert not cache.prompt_mask[cache.slot_of[seq.seq_id]].any()
        engine.abort_request("penalized")
    with LLM(str(qwen3_dir), **ENGINE) as fresh:
        assert fresh.generate([[0] * 40], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == zeros.outputs[0].token_ids


@pytest.mark.parametrize("prompt, kwargs, exc, match", [
    ({"prompt_embeds": torch.zeros(3, 32)}, {}, ValueError, r"must be \[tokens > 0, 64\] .* got \[3, 32\]"),
    ({"prompt_embeds": torch.zeros(0, 64)}, {}, ValueError, r"got \[0, 64\]"),
    ({"prompt_embeds": torch.zeros(64)}, {}, ValueError, r"got \[64\]"),
    ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.long)}, {}, TypeError, "floating-point torch.Tensor, got "
                                                                             "torch.int64"),
    ({"prompt_embeds": [[0.0] * 64]}, {}, TypeError, "floating-point torch.Tensor, got list"),
    ({"prompt_embeds": torch.zeros(3, 64), "prompt": "x"}, {}, ValueError, "holds only 'prompt_embeds'"),
    ({"prompt_embeds": torch.zeros(3, 64)}, {"prompt_logprobs": 1}, ValueError, "prompt_logprobs=1 needs the prompt's "
                                                                                "token ids"),
])
def test_bad_prompt_embeds_are_refused_by_name(qwen3_dir, prompt, kwargs, exc, match):
    with LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=True) as llm:
        assert llm.llm_engine.model_runner.prompt_embedding.embedding_dim == 64
        with pytest.raises(exc, match=match):
            llm.generate([[1, 2], prompt], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_embeds are taken by generate, generate_iter and add_request"):
            llm.beam_search([{"prompt_embeds": torch.zeros(2, 64)}], BeamSearchParams(beam_width=2, max_tokens=2))
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.generate([1, 2], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_embeds_need_the_flag(qwen3_dir):
    with LLM(str(qwen3_dir), **ENGINE) as llm:
        with pytest.raises(ValueError, match=r"prompt_embeds needs LLM\(enable_prompt_embeds=True\)"):
            llm.generate({"prompt_embeds": torch.zeros(2, 64)}, use_tqdm=False)
    with pytest.raises(TypeError, match="enable_prompt_embeds must be a bool, got 1"):
        LLM(str(qwen3_dir), **ENGINE, enable_prompt_embeds=1)
