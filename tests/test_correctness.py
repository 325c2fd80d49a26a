"""nanoinfer vs transformers (fp32, CPU): greedy tokens and logits on tiny random models, under every schedule."""
import pytest
import torch

from models import EXTRA_KINDS, LLAMA4_CHUNK, MODEL_KINDS, SLIDING_WINDOW, cached_hf_greedy, check_against_hf
from models import REFERENCE_MAX_TOKENS as MAX_TOKENS
from models import REFERENCE_PROMPTS as PROMPTS
from models import random_prompts
from nanoinfer import LLM, SamplingParams

LOGIT_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(model_dir, prompts=PROMPTS) -> list[dict]:
    return cached_hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kind", MODEL_KINDS + ("qwen3-sharded",) + EXTRA_KINDS)
def test_greedy_and_logits_match_hf(kind, model_dir, captured_logits, report_logit_diff):
    d = model_dir(kind)
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=256)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS and o.outputs[0].finish_reason == "length" for o in outputs)
    worst = check_against_hf(outputs, reference(d), captured_logits)
    report_logit_diff(kind, worst)
    assert worst < LOGIT_ATOL, f"{kind}: max |logit diff| vs transformers {worst:.2e}"


def test_chunked_prefill_matches_hf(qwen2_dir, captured_logits, report_logit_diff):
    # A 7-token budget splits every prompt into many chunks, some ending mid-block.
    llm = LLM(str(qwen2_dir), device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=7)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, reference(qwen2_dir), captured_logits)
    report_logit_diff("qwen2, chunked prefill", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_preemption_matches_hf(llama_dir, captured_logits, report_logit_diff):
    # 8 blocks of 16 tokens cannot hold all sequences at once: decode must preempt and recompute.
    llm = LLM(str(llama_dir), device="cpu", dtype="float32",
              max_model_len=128, num_kvcache_blocks=8, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    worst = check_against_hf(outputs, reference(llama_dir), captured_logits)
    report_logit_diff("llama, preemption", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hits_match_hf(qwen3_dir, captured_logits, report_logit_diff):
    shared = random_prompts(1, 5, 440, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(4, 5, 440, 1, 20, seed=4)] + [shared]
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    # Admitted in the same step, the later prompts share the first one's two full prefix blocks.
    assert [o.num_cached_tokens for o in first] == [0, 32, 32, 32, 32]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in second)
    refs = reference(qwen3_dir, prompts)
    worst = max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))
    report_logit_diff("qwen3, prefix-cache hits", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_prefix_cache_with_chunks_and_preemption(qwen3_untied_dir):
    """Everything at once: shared prefixes, tiny budget, tiny cache. Tokens equal a plain run's."""
    shared = random_prompts(1, 5, 440, 35, 35, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(6, 5, 440, 1, 20, seed=6)]
    plain = LLM(str(qwen3_untied_dir), device="cpu", dtype="float32", max_model_len=80, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(qwen3_untied_dir), device="cpu", dtype="float32",
              max_model_len=80, num_kvcache_blocks=10, max_num_batched_tokens=20,
              kvcache_block_size=8)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", sorted(SLIDING_WINDOW))
def test_sliding_window_chunked_prefill_and_prefix_cache_match_hf(kind, model_dir, captured_logits,
                                                                  report_logit_diff):
    """Contexts several windows long, prefilled in 7-token chunks, then again with a 40-token cached prefix; the
    window (9, 12 or 20) is not a multiple of the block size (8)."""
    d = model_dir(kind)
    shared = random_prompts(1, 5, 440, 40, 40, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 1, 30, seed=9)]
    refs = reference(d, prompts)
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=7, kvcache_block_size=8)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 40 for o in second)
    worst = max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))
    report_logit_diff(f"{kind}, sliding window, chunked + prefix cache", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("kind, limit, per_layer", [
    ("qwen2-swa", "sliding_window", [None, SLIDING_WINDOW["qwen2-swa"], SLIDING_WINDOW["qwen2-swa"]]),
    ("llama4", "attention_chunk_size", [LLAMA4_CHUNK] * 3 + [None]),  # its rope layers, not the NoPE one
])
def test_window_or_chunks_are_what_makes_the_match(kind, limit, per_layer, model_dir, captured_logits):
    """The same weights attending to the whole context diverge from transformers: the window tests, and Llama 4's
    (chunked local attention, the prompts here crossing several chunks), can fail."""
    from nanoinfer.layers.attention import Attention

    d = model_dir(kind)
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=256)
    layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, Attention)]
    assert [getattr(a, limit) for a in layers] == per_layer
    for a in layers:
        setattr(a, limit, None)
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    refs = reference(d)
    ours = torch.stack(captured_logits[outputs[0].request_id])
    assert (ours[0] - refs[0]["logits"][0]).abs().max().item() > 1e-2


def test_string_prompts_and_eos(llama_dir):
    """String prompts are tokenized like transformers does; an EOS from generation_config (a list) stops."""
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256)
    tok = llm.tokenizer
    request = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert request.prompt_token_ids == tok.encode("The quick brown fox")
    out = request.outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    # Make EOS the greedy continuation: generation stops right there with reason "stop".
    first = out.token_ids[0]
    llm.llm_engine.eos_token_ids.add(first)
    stopped = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]
    # vLLM's convention: stop_reason names a stop token or string, and is None for EOS.
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == out.token_ids and ignored.finish_reason == "length"
    assert llm.llm_engine.config.eos_token_ids == [0, 4]
