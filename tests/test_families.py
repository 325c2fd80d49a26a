"""Dense families beyond the shared correctness tests (tests/test_correctness.py) without a file of their own (OLMo:
test_olmo.py; MoE: test_moe.py): tensor parallelism against transformers, transformers' bf16 arithmetic in Gemma's
norm, Gemma 3's Hub config layout, and the Gemma config settings the engine refuses by name."""
import json
import shutil

import pytest
import torch

from models import cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.layernorm import GemmaRMSNorm

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(3, 5, 440, 5, 60, seed=31) + [[17]]
LOGIT_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "phi3", "gemma2", "granite", "smollm3"])
def test_tensor_parallel_2_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker): each holds half the heads and MLP; windows, ropes and norms per rank."""
    d = model_dir(kind)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits)
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_gemma_norm_in_bf16_is_transformers_own():
    """Gemma3RMSNorm keeps w in the model's dtype, adds 1 and multiplies in fp32, then casts: bit for bit, from an
    fp32 checkpoint into a bf16 model, with and without the residual add before it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(64, generator=g)  # the checkpoint's (fp32) weight
    hf = Gemma3RMSNorm(64).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the engine builds a bf16 model
    try:
        ours = GemmaRMSNorm(64)
    finally:
        torch.set_default_dtype(default)
    ours.weight_loader(ours.weight, w)
    x, residual = (3 * torch.randn(2, 5, 64, generator=g)).bfloat16(), torch.randn(2, 5, 64, generator=g).bfloat16()
    assert torch.equal(ours(x), hf(x))
    out, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(out, hf(x + residual))


def edited_model(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_gemma3_hub_config_layout_matches_hf(model_dir, tmp_path, captured_logits):
    """The layout of the Hub's Gemma 3 config.json files (rope_theta, rope_local_base_freq, rope_scaling, a
    sliding_window_pattern instead of layer_types), which transformers converts on load."""
    d = edited_model(model_dir("gemma3"), tmp_path / "m", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                     rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=2)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_parameters"], cfg["layer_types"]
    (d / "config.json").write_text(json.dumps(cfg))
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits) < LOGIT_ATOL


@pytest.mark.parametrize("kind, changes, message", [
    # transformers' Gemma 3 reads attn_logit_softcapping but never applies it: no reference to match.
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
])
def test_gemma_settings_the_engine_cannot_run_are_refused_by_name(kind, model_dir, tmp_path, changes, message):
    d = edited_model(model_dir(kind), tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
