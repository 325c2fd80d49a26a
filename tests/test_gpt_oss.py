"""GPT-OSS beyond the shared suites (test_correctness.py: greedy tokens and logits, sliding windows under chunked
prefill and prefix hits; triton_attention_interpreted.py: the Triton backend): its MoE layer against transformers'
(checkpoint layout, biases, clamped SwiGLU, router) and across tensor-parallel shards, the whole model under
chunked prefill, prefix hits and preemption with TP=1 and 2, what the sinks and the clamps change, and the settings
it refuses (flash-attn, which has no sinks; MXFP4 checkpoints)."""
import json
import shutil

import pytest
import torch

import nanoinfer.layers.fused_moe as fused_moe
from models import (GPT_OSS_GATE_UP_STD, cached_hf_greedy, check_against_hf, chunked_prefix_preemption_logit_diff,
                    make_config, random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.layers.attention import Attention, selector
from nanoinfer.models.gpt_oss import GptOssExperts, GptOssMLP
from nanoinfer.utils.loader import load_weights

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LOGIT_ATOL = 1e-4


def hf_mlp(seed: int = 0):
    """transformers' GPT-OSS MoE layer with random weights, the gate/up ones as the test model has them."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as HFMLP

    config = make_config("gpt-oss")
    torch.manual_seed(seed)
    mlp = HFMLP(config).eval()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.normal_(0, GPT_OSS_GATE_UP_STD if name == "experts.gate_up_proj" else 0.2)
    return config, mlp


def checkpoint(mlp, keep: str = "") -> list[tuple[str, torch.Tensor]]:
    """The layer's tensors under the names a GPT-OSS checkpoint gives them (those containing `keep`)."""
    return [(f"mlp.{name}", p.detach()) for name, p in mlp.named_parameters() if keep in name]


@torch.inference_mode()
def test_moe_layer_matches_transformers_and_its_shards(monkeypatch):
    """Ours from transformers' tensors (gate/up interleaved, [in, out] weights, biases) equals its layer; two ranks'
    halves of every expert add up to it (the down bias counted once). The clamps bind (|pre-activation| > limit) for
    many values, and the output depends on them."""
    config, ref = hf_mlp()
    x = torch.randn(37, config.hidden_size)
    expected = ref(x.unsqueeze(0))[0][0]
    ours = torch.nn.ModuleDict({"mlp": GptOssMLP(config)})
    load_weights(ours, checkpoint(ref))
    assert (ours.mlp(x) - expected).abs().max().item() < 1e-5 * expected.abs().max().item()  # fp32 rounding
    assert expected.abs().mean().item() > 0.1

    pre = torch.einsum("th,ehi->tei", x, ref.experts.gate_up_proj) + ref.experts.gate_up_proj_bias
    assert (pre[..., ::2] > 7).float().mean() > 0.05 and (pre[..., 1::2].abs() > 7).float().mean() > 0.05
    unclamped = fused_moe.clamped_swiglu(1.702, float("inf"))
    monkeypatch.setattr(ours.mlp.experts, "activation", unclamped)
    assert (ours.mlp(x) - expected).abs().max().item() > 1e-2

    logits = ours.mlp.router(x)
    monkeypatch.setattr(fused_moe, "tp_size", lambda: 2)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(fused_moe, "tp_rank", lambda: rank)
        shard = GptOssExperts(8, 2, config.hidden_size, 32, renormalize=True, reduce_results=False, bias=True,
                              activation=fused_moe.clamped_swiglu(1.702, 7.0))
        load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": shard})}),
                     checkpoint(ref, "experts."))
        assert shard.w13_weight.shape == (8, 32, config.hidden_size) and shard.w13_bias.shape == (8, 32)
        parts.append(shard(x, logits))
    assert (parts[0] + parts[1] - expected).abs().max().item() < 1e-5 * expected.abs().max().item()
    assert (parts[0] - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_chunked_prefill_prefix_cache_and_preemption_match_hf(tp, model_dir, captured_logits, report_logit_diff):
    """7-token chunks (after a cached prefix, each query row through the C decode kernel with the sinks), preemption,
    and with two ranks, each holding half the heads with their sinks and half of every expert."""
    worst = chunked_prefix_preemption_logit_diff(model_dir("gpt-oss"), captured_logits, MAX_TOKENS,
                                                 tensor_parallel_size=tp)
    report_logit_diff(f"gpt-oss, chunked + prefix cache + preemption, TP={tp}", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_prefix_hits_then_sinks_and_windows_are_what_makes_the_match(model_dir, captured_logits):
    """Prompts of 25 to 31 tokens run twice: the second time, 9 to 15 tokens over a cached block (more rows than the
    decode kernel takes: the sinks in the PyTorch backend's explicit scores), matching transformers; the same
    weights without sinks, or without the sliding layers' window, do not."""
    d = model_dir("gpt-oss")
    shared = random_prompts(1, 5, 440, 20, 20, seed=51)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 5, 11, seed=52)]
    refs = cached_hf_greedy(d, prompts, MAX_TOKENS)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=64) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens == 16 for o in second)
        assert check_against_hf(second, refs, captured_logits) < LOGIT_ATOL
        layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, Attention)]
        assert [a.sliding_window for a in layers] == [12, None, 12]
        for change in ("sinks", "sliding_window"):
            saved = [getattr(a, change) for a in layers]
            for a in layers:
                setattr(a, change, None)
            output = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
            for a, value in zip(layers, saved):
                setattr(a, change, value)
            first = torch.stack(captured_logits[output.request_id])[0]
            assert (first - refs[0]["logits"][0]).abs().max().item() > 1e-2, change


def test_flash_attn_is_not_chosen_for_sinks(monkeypatch, model_dir):
    """flash-attn 2 has no sinks: with it installed, CUDA's default for GPT-OSS is the Triton backend, and asking
    for flash is refused by name (before anything about the device)."""
    monkeypatch.setattr(selector, "flash_attn_available", lambda: True)
    monkeypatch.setattr(selector, "_check_triton", lambda device: None)
    cuda = torch.device("cuda")
    assert selector.select_backend("auto", cuda) == "flash"
    assert selector.select_backend("auto", cuda, attention_sinks=True) == "triton"
    with pytest.raises(ValueError, match="attention_backend='flash' cannot run this model: its attention has sinks"):
        selector.select_backend("flash", cuda, attention_sinks=True)
    with pytest.raises(ValueError, match="has sinks"):
        Config(str(model_dir("gpt-oss")), device="cpu", attention_backend="flash")


def test_mxfp4_checkpoint_is_refused(model_dir, tmp_path):
    """The usual GPT-OSS release: MXFP4 experts, announced by its quantization_config."""
    d = shutil.copytree(model_dir("gpt-oss"), tmp_path / "mxfp4")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='mxfp4'.*not supported"):
        Config(str(d), device="cpu")
