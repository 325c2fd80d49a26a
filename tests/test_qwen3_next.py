"""Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention) vs transformers under every schedule and with two
tensor-parallel ranks, their linear attention sharded over two fake ranks vs transformers' layer, the per-sequence
recurrent state's lifecycle, and the delta rule's chunked form against its recurrent form."""
import pytest
import torch

from models import QWEN3_NEXT_KINDS, cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers import gated_delta_rule
from nanoinfer.layers.gated_delta_rule import (GatedDeltaRule, chunk_gated_delta_rule, l2norm,
                                               recurrent_gated_delta_rule)
from nanoinfer.layers.recurrent import causal_conv1d
from nanoinfer.models.qwen3_5 import Qwen3_5GatedDeltaNet
from nanoinfer.models.qwen3_next import Qwen3NextGatedDeltaNet
from nanoinfer.utils.dist import tp_scope

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
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        worst = check_against_hf(outputs, reference(model_dir, prompts), captured)
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert sorted(bm.free_state_slots) == list(range(llm.llm_engine.model_runner.num_state_slots))
    except BaseException:  # a tensor-parallel engine left open would fail every later one in this process
        llm.close()
        raise
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
@pytest.mark.parametrize("kind", ["qwen3-next", "qwen3.5-moe"])
def test_tensor_parallel_2_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker), on Qwen3-Next (projections grouped by key head) and Qwen3.5-MoE (per output):
    the full-attention layers, the MLPs (experts, shared expert) and the linear attention sharded, each rank with its
    heads' state."""
    llm, _, worst = run(model_dir(kind), captured_logits, tensor_parallel_size=2)
    with llm:  # closed (the worker too) before asserting
        heads = [m.ssm_state.shape[1] for m in llm.llm_engine.model_runner.model.modules()
                 if isinstance(m, GatedDeltaRule)]
        total = llm.llm_engine.config.hf_config.linear_num_value_heads
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    assert heads and all(h * 2 == total for h in heads), f"value heads per rank {heads} of {total}"


def _hf_gated_delta_net(kind: str) -> tuple[torch.nn.Module, object]:
    """transformers' linear attention of `kind` (4 key heads, 2 value heads each, k_dim != v_dim) with random
    weights, and its config."""
    shape = dict(hidden_size=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                 layer_types=["linear_attention"])
    if kind == "qwen3-next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as HFGatedDeltaNet

        config = Qwen3NextConfig(**shape)
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as HFGatedDeltaNet

        config = Qwen3_5TextConfig(**shape)
    hf = HFGatedDeltaNet(config, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        hf.A_log.copy_(torch.linspace(0.01, 2.0, hf.A_log.numel()).log())  # decays from almost none to strong
    return hf, config


@pytest.mark.parametrize("kind", ["qwen3-next", "qwen3.5"])
@torch.inference_mode()
def test_gated_delta_net_sharded_over_two_ranks_matches_transformers(kind, monkeypatch):
    """Two ranks (threads in a fake group, tests/test_ssm.py's): each holds 2 of the 4 key heads and their 4 value
    heads (their in_proj rows, q | k | v conv channels and state, out_proj's input columns); over a prompt past the
    64-token chunk, prompt chunks, decode steps and several sequences at once, their all-reduced outputs equal
    transformers' layer over each whole sequence."""
    from test_ssm import run_in_steps, run_ranks, shard_over_ranks  # test_ssm imports this module

    hf, config = _hf_gated_delta_net(kind)
    layer_class = Qwen3NextGatedDeltaNet if kind == "qwen3-next" else Qwen3_5GatedDeltaNet
    ranks = shard_over_ranks(lambda: layer_class(config), hf, 2)
    in_proj_rows = sum(m.weight.shape[0] for name, m in hf.named_children() if name.startswith("in_proj"))
    for layer in ranks:
        assert layer.delta_rule.ssm_state.shape[1:] == (4, 8, 6)
        assert layer.delta_rule.conv_state.shape[-1] * 2 == hf.conv1d.weight.shape[0]
        assert sum(m.weight.shape[0] for name, m in layer.named_children() if name.startswith("in_proj")) * 2 == (
            in_proj_rows)
        assert layer.out_proj.weight.shape[1] * 2 == hf.out_proj.weight.shape[1]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(n, 32, generator=g) for n in (70, 19, 6)]
    expected = [hf(seq[None])[0] for seq in x]
    for outputs in run_ranks(monkeypatch, [lambda m=m: run_in_steps(m, x, first_prefill=70) for m in ranks]):
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_gated_delta_net_key_heads_must_split_over_ranks():
    config = _hf_gated_delta_net("qwen3-next")[1]
    with tp_scope(0, 3, None), pytest.raises(ValueError, match="linear_num_key_heads=4 does not split over "
                                                               "tensor_parallel_size=3"):
        Qwen3NextGatedDeltaNet(config)


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


# The recurrence's forms: Gated DeltaNet's (a decay per head), Kimi Delta Attention's (a decay per key channel) and
# MiniMax's lightning attention (a decay per head, no delta rule: beta None).
FORMS = ("per-head", "per-channel", "no-delta")


def _delta_rule_inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0, form: str = "per-head"):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g, dtype=torch.float64))
    v = torch.randn(n, heads, dv, generator=g, dtype=torch.float64)
    # Decay rates from almost none to strong, as A_log and dt_bias give: per head, or per key channel as well.
    rates = torch.tensor([0.01, 0.3, 2.0], dtype=torch.float64)
    if form == "per-channel":
        decay = -torch.rand(n, heads, dk, generator=g, dtype=torch.float64) * rates[:, None] * torch.linspace(
            0.1, 1.0, dk, dtype=torch.float64)
    else:
        decay = -torch.rand(n, heads, generator=g, dtype=torch.float64) * rates
    beta = torch.rand(n, heads, generator=g, dtype=torch.float64)
    state = torch.randn(heads, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, None if form == "no-delta" else beta, state


def _rows(x: torch.Tensor | None, s) -> torch.Tensor | None:
    return None if x is None else x[s]


def _recurrent(q, k, v, decay, beta, state):
    state, out = state.clone().unsqueeze(0), []
    for t in range(q.shape[0]):
        s = slice(t, t + 1)
        out.append(recurrent_gated_delta_rule(q[s], k[s], v[s], decay[s], _rows(beta, s), state))
    return torch.cat(out), state[0]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pieces", [[150], [1, 63, 64, 22], [7] * 21 + [3], [64, 64, 22]])
def test_chunked_form_matches_recurrent_form(pieces, form):
    """The chunked form (prefill), over a prompt split anywhere, equals the recurrent form (decode) token by token."""
    q, k, v, decay, beta, state = _delta_rule_inputs(sum(pieces), form=form)
    expected_out, expected_state = _recurrent(q, k, v, decay, beta, state)
    out, start = [], 0
    for n in pieces:
        s = slice(start, start + n)
        o, state = chunk_gated_delta_rule(q[s], k[s], v[s], decay[s], _rows(beta, s), state)
        out.append(o)
        start += n
    torch.testing.assert_close(torch.cat(out), expected_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-10)
    assert expected_state.abs().max() > 0.1 and expected_out.abs().max() > 0.1


@pytest.mark.parametrize("form, chunk", [("per-head", 64), ("per-channel", 8), ("no-delta", 64)])
def test_chunk_size_follows_the_decay(form, chunk, monkeypatch):
    """A decay per key channel makes each chunk's products [H, C, C, dk] elementwise, C^2 per chunk: its chunks are
    8 tokens (64, a decay per head's, took 10-28x as long on 2k-token prompts)."""
    sizes, products = [], gated_delta_rule._decayed_products

    def recording(a: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        sizes.append(a.shape[-2])
        return products(a, *rest)

    monkeypatch.setattr(gated_delta_rule, "_decayed_products", recording)
    q, k, v, decay, beta, state = _delta_rule_inputs(150, form=form)
    chunk_gated_delta_rule(q, k, v, decay, beta, state)
    assert set(sizes) == {chunk}


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
