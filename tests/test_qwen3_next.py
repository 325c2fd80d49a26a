"""Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention) vs transformers under every schedule and with two
tensor-parallel ranks, the per-sequence recurrent state's lifecycle, and the delta rule's chunked form against its
recurrent form."""
import pytest
import torch

from models import QWEN3_NEXT_KINDS, cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.gated_delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from nanoinfer.layers.recurrent import causal_conv1d

MAX_TOKENS = 16
LOGIT_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Different lengths in one batch, two of them over the delta rule's 64-token chunk, and a one-token prompt
# (a single-row step at position 0).
PROMPTS = random_prompts(6, 5, 440, 2, 110, seed=12) + [[17]]


def reference(model_dir, prompts=PROMPTS) -> list[dict]:
    return cached_hf_greedy(model_dir, prompts, MAX_TOKENS)


def run(model_dir, captured, prompts=PROMPTS, **kwargs):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128, **kwargs)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, reference(model_dir, prompts), captured)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_state_slots) == list(range(llm.llm_engine.model_runner.num_state_slots))
    return llm, outputs, worst


@pytest.fixture(scope="module", params=QWEN3_NEXT_KINDS)
def next_dir(request, model_dir):
    return model_dir(request.param)


def test_greedy_and_logits_match_hf(next_dir, captured_logits, report_logit_diff):
    llm, outputs, worst = run(next_dir, captured_logits)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert llm.llm_engine.model_runner.num_state_slots == llm.llm_engine.config.max_num_seqs
    report_logit_diff(f"{next_dir.name}, state slots", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| vs transformers {worst:.2e}"


def test_chunked_prefill_matches_hf(next_dir, captured_logits, report_logit_diff):
    # A 7-token budget splits prompts into chunks ending anywhere, carried over in the recurrent state; 3 slots
    # for 7 prompts means slots are reused, so a stale state must be reset for its next sequence.
    llm, _, worst = run(next_dir, captured_logits, max_num_batched_tokens=7, max_num_seqs=3)
    assert llm.llm_engine.model_runner.num_state_slots == 3
    report_logit_diff(f"{next_dir.name}, chunked prefill", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_preemption_matches_hf(next_dir, captured_logits, report_logit_diff):
    # 8 blocks of 16 tokens cannot hold all sequences: preempted ones lose their state and recompute from scratch.
    llm, _, worst = run(next_dir, captured_logits, num_kvcache_blocks=8, max_num_batched_tokens=64)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    report_logit_diff(f"{next_dir.name}, preemption", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf(model_dir, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker), on Qwen3.5-MoE (whose layers are Qwen3-Next's): the full-attention layers and
    the MLPs (experts, shared expert) sharded, the linear attention replicated on each rank with its own state."""
    _, _, worst = run(model_dir("qwen3.5-moe"), captured_logits, tensor_parallel_size=2)
    report_logit_diff("qwen3.5-moe, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_no_prefix_cache_reuse(next_dir, captured_logits):
    """A cached prefix has K/V but no recurrent state: prefix caching is off for these models, even when asked."""
    shared = random_prompts(1, 5, 440, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 1, 20, seed=4)] + [shared]
    llm = LLM(str(next_dir), device="cpu", dtype="float32", max_model_len=128, enable_prefix_caching=True)
    assert not llm.llm_engine.scheduler.block_manager.enable_prefix_caching
    for _ in range(2):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens == 0 for o in outputs)
        assert check_against_hf(outputs, reference(next_dir, prompts), captured_logits) < LOGIT_ATOL


def _delta_rule_inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64))
    v = torch.randn(n, heads, dv, generator=g, dtype=torch.float64)
    # Per-head decay rates from almost none to strong, as A_log and dt_bias give.
    decay = -torch.rand(n, heads, generator=g, dtype=torch.float64) * torch.tensor([0.01, 0.3, 2.0])
    beta = torch.rand(n, heads, generator=g, dtype=torch.float64)
    state = torch.randn(heads, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


def _recurrent(q, k, v, decay, beta, state):
    state, out = state.clone().unsqueeze(0), []
    for t in range(q.shape[0]):
        out.append(recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], state))
    return torch.cat(out), state[0]


@pytest.mark.parametrize("pieces", [[150], [1, 63, 64, 22], [7] * 21 + [3], [64, 64, 22]])
def test_chunked_form_matches_recurrent_form(pieces):
    """The chunked form (prefill), over a prompt split anywhere, equals the recurrent form (decode) token by token."""
    q, k, v, decay, beta, state = _delta_rule_inputs(sum(pieces))
    expected_out, expected_state = _recurrent(q, k, v, decay, beta, state)
    out, start = [], 0
    for n in pieces:
        s = slice(start, start + n)
        o, state = chunk_gated_delta_rule(q[s], k[s], v[s], decay[s], beta[s], state)
        out.append(o)
        start += n
    torch.testing.assert_close(torch.cat(out), expected_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-10)
    assert expected_state.abs().max() > 0.1 and expected_out.abs().max() > 0.1


def test_recurrent_form_batched_over_sequences():
    """One decode step of several sequences at once equals each sequence stepped alone."""
    seqs = [_delta_rule_inputs(1, seed=s) for s in range(4)]
    stacked = [torch.cat([x[i] if i < 5 else x[i].unsqueeze(0) for x in seqs]) for i in range(6)]
    state = stacked[5].clone()
    out = recurrent_gated_delta_rule(*stacked[:5], state)
    for i, (q, k, v, decay, beta, s) in enumerate(seqs):
        o, final = _recurrent(q, k, v, decay, beta, s)
        torch.testing.assert_close(out[i], o[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(state[i], final, rtol=0, atol=1e-12)


def test_causal_conv_carries_state_across_chunks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)
    expected = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.T.unsqueeze(0), weight.unsqueeze(1), padding=3, groups=6)[0, :, :30].T)
    state, out = torch.zeros(3, 6, dtype=torch.float64), []
    for start, end in [(0, 1), (1, 2), (2, 13), (13, 14), (14, 30)]:
        y, state = causal_conv1d(x[start:end], state, weight)
        out.append(y)
    torch.testing.assert_close(torch.cat(out), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, x[-3:], rtol=0, atol=0)


def test_embed_is_refused(next_dir):
    llm = LLM(str(next_dir), device="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="bidirectional encoder"):
        llm.embed([[5, 6, 7]])
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS  # still usable


def test_multi_token_prediction_weights_are_skipped(next_dir, tmp_path):
    """Real checkpoints carry `mtp.*` tensors (transformers ignores them too); any other stray still fails."""
    from safetensors.torch import load_file, save_file

    weights = load_file(next_dir / "model.safetensors")
    for extra, ok in [("mtp.fc.weight", True), ("model.extra.weight", False)]:
        d = tmp_path / extra
        d.mkdir()
        for f in next_dir.iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file({**weights, extra: torch.zeros(4, 4)}, d / "model.safetensors")
        if ok:
            LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
        else:
            with pytest.raises(ValueError, match="model.extra.weight"):
                LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
