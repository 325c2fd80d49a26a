"""OLMo 2 / OLMo 3 specifics beyond the shared correctness tests (tests/test_correctness.py): tensor parallelism with
the full-width q/k norms split across ranks, schedules and the encoder pass on OLMo 2, transformers' bf16 norm,
the Hub's OLMo 3 config layout."""
import json
import shutil

import pytest
import torch

from models import (OLMO2_MQA_KIND, build_model, cached_hf_greedy, check_against_hf,
                    chunked_prefix_preemption_logit_diff, hf_encoder_states, random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.layernorm import OlmoRMSNorm
from nanoinfer.models.olmo2 import Olmo2QKNorm

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(3, 5, 440, 5, 60, seed=31) + [[17]]
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def olmo2_mqa_dir(tmp_path_factory):
    return build_model(OLMO2_MQA_KIND, tmp_path_factory.mktemp("olmo") / OLMO2_MQA_KIND)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["olmo2", "olmo3", OLMO2_MQA_KIND])
def test_tensor_parallel_2_matches_hf(kind, model_dir, request, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker), each with half the query heads and its slice of the q norm; the k norm's slice
    is half of it with 2 KV heads, all of it with one (replicated on both ranks): the norms' mean squares are the
    full projections' all the same."""
    d = request.getfixturevalue("olmo2_mqa_dir") if kind == OLMO2_MQA_KIND else model_dir(kind)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits)
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_olmo2_chunked_prefill_prefix_hits_and_preemption_match_hf(model_dir, captured_logits, report_logit_diff):
    """7-token chunks, a shared 40-token prefix and a cache too small for all the sequences at once, twice."""
    worst = chunked_prefix_preemption_logit_diff(model_dir("olmo2"), captured_logits, MAX_TOKENS)
    report_logit_diff("olmo2, chunked prefill + prefix hits + preemption", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_olmo2_embeddings_match_transformers(model_dir):
    """The encoder pass (no rope): the q/k norms still apply."""
    d = model_dir("olmo2")
    prompts = random_prompts(3, 5, 440, 1, 40, seed=11)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=64) as llm:
        outputs = llm.embed(prompts, pooling="last")
    for out, prompt in zip(outputs, prompts):
        ours = torch.tensor(out.outputs.embedding)
        assert (ours - hf_encoder_states(d, prompt)[-1]).abs().max().item() < LOGIT_ATOL


def test_olmo_norms_in_bf16_are_transformers_own():
    """Olmo2RMSNorm multiplies its model-dtype weight in fp32 and casts after (Llama's RMSNorm casts before): bit for
    bit, from an fp32 checkpoint into a bf16 model, for the hidden-size norms and the q norm (given the full rows'
    mean square, as tensor parallelism computes it)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    g = torch.Generator().manual_seed(0)
    w = 1 + 0.3 * torch.randn(64, generator=g)  # the checkpoint's (fp32) weight
    hf = Olmo2RMSNorm(64).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the engine builds a bf16 model
    try:
        norm, q_norm = OlmoRMSNorm(64), Olmo2QKNorm(4, 16, 1e-6)
    finally:
        torch.set_default_dtype(default)
    norm.weight_loader(norm.weight, w)
    q_norm.weight_loader(q_norm.weight, w)
    x = (3 * torch.randn(5, 64, generator=g)).bfloat16()
    assert torch.equal(norm(x), hf(x))
    assert torch.equal(q_norm.scale(x, x.float().pow(2).mean(-1, keepdim=True)), hf(x))


def test_test_models_norms_are_full_width_and_random(model_dir):
    """What lets the tests above fail on a per-head or forgotten norm: q/k norms over all heads, none all ones."""
    from safetensors.torch import load_file

    weights = load_file(model_dir("olmo2") / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 16,)
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (2 * 16,)
    norms = [w for name, w in weights.items() if "norm" in name]
    assert len(norms) == 3 * 4 + 1 and all(w.std() > 0.1 for w in norms)


def test_per_head_q_norm_in_the_checkpoint_is_refused():
    q_norm = Olmo2QKNorm(4, 16, 1e-6)
    with pytest.raises(ValueError, match="checkpoint q/k norm has 16 weights, expected 64"):
        q_norm.weight_loader(q_norm.weight, torch.ones(16))


def test_olmo3_hub_config_layout_matches_hf(model_dir, tmp_path, captured_logits):
    """The layout of the Hub's OLMo 3 config.json files (rope_theta and a yarn rope_scaling, which transformers
    gives the full layers only, the sliding ones keeping the default rope)."""
    d = tmp_path / "m"
    shutil.copytree(model_dir("olmo3"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=500_000.0, rope_scaling={"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.2,
                                                   "beta_fast": 32, "beta_slow": 1,
                                                   "original_max_position_embeddings": 64})
    (d / "config.json").write_text(json.dumps(cfg))
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
        assert llm.llm_engine.config.hf_config.rope_parameters["sliding_attention"]["rope_type"] == "default"
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits) < LOGIT_ATOL
