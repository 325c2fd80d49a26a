"""LLM.embed: the decoder as a bidirectional encoder without RoPE, pooled, against transformers run the same way."""
import pytest
import torch
import torch.nn.functional as F

from models import hf_encoder_states, random_prompts
from nanoinfer import LLM, SamplingParams

PROMPTS = random_prompts(5, 5, 440, 1, 70, seed=11) + [[42]]
ATOL = 1e-4


def test_reference_is_bidirectional_and_position_free(llama_dir):
    """The reference itself: a later token changes the first token's state, and permuting the input permutes the
    states (no position information), unlike transformers' causal forward."""
    ids = PROMPTS[0][:12]
    h = hf_encoder_states(llama_dir, ids)
    changed = hf_encoder_states(llama_dir, ids[:-1] + [ids[-1] + 1])
    assert (changed[0] - h[0]).abs().max().item() > 1e-2
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    permuted = hf_encoder_states(llama_dir, [ids[i] for i in perm])
    assert (permuted - h[perm]).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-moe", "qwen3-swa"])
def test_embeddings_match_transformers(kind, model_dir, report_logit_diff):
    d = model_dir(kind)
    # A 100-token budget splits the prompts over several encoder batches.
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=100)
    states = [hf_encoder_states(d, p) for p in PROMPTS]
    worst = 0.0
    for pooling, pool in (("mean", lambda h: h.mean(0)), ("last", lambda h: h[-1])):
        outputs = llm.embed(PROMPTS, pooling=pooling)
        assert [o.prompt_token_ids for o in outputs] == PROMPTS
        assert len({o.request_id for o in outputs}) == len(PROMPTS)
        for out, h in zip(outputs, states):
            ours = torch.tensor(out.outputs.embedding)
            assert ours.shape == (64,)
            worst = max(worst, (ours - pool(h)).abs().max().item())
    report_logit_diff(f"{kind}, embeddings (max |diff|)", worst)
    assert worst < ATOL, f"max |embedding diff| {worst:.2e}"
    normalized = llm.embed(PROMPTS[:2], pooling="last", normalize=True)
    for out, h in zip(normalized, states):
        assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(h[-1], dim=0), atol=ATOL)


def test_embed_strings_errors_and_generation_untouched(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    text = "The quick brown fox"
    out = llm.embed(text, pooling="last")
    assert len(out) == 1 and out[0].prompt == text and out[0].prompt_token_ids == llm.tokenizer.encode(text)
    assert torch.allclose(torch.tensor(out[0].outputs.embedding), hf_encoder_states(qwen3_dir, out[0].prompt_token_ids)[-1],
                          atol=ATOL)
    for bad, error, match in [(dict(prompts=[[1, 2]], pooling="max"), ValueError, "pooling"),
                              (dict(prompts=[[]]), ValueError, "empty"),
                              (dict(prompts=[list(range(5, 140))]), ValueError, "max_model_len"),
                              (dict(prompts=[[1, 2], [9999]]), ValueError, "vocabulary"),
                              (dict(prompts=[[1, 2]], normalize="yes"), TypeError, "normalize")]:
        with pytest.raises(error, match=match):
            llm.embed(**bad)
    # Embedding writes nothing to the KV cache: generation (with its prefix cache) is unchanged.
    after = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
