"""LLM.classify and LLM.score on sequence-classification checkpoints, and LLM.embed(causal=True), against
transformers' AutoModelForSequenceClassification and causal forward on the same weights."""
import json
import pathlib
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models import hf_attention, load_hf_model, random_prompts
from nanoinfer import LLM, SamplingParams

# Lengths 1 to 40: past every test window, and a one-token prompt.
PROMPTS = random_prompts(6, 5, 440, 2, 40, seed=23) + [[42]]
ATOL = 1e-4


def classifier_dir(src: pathlib.Path, dst: pathlib.Path, num_labels: int) -> pathlib.Path:
    """src's decoder with a random `score` head of num_labels in place of its LM head, saved as transformers'
    *ForSequenceClassification checkpoint (no pad token: transformers then reads every prompt's last token)."""
    if dst.exists():
        return dst
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    family = config["architectures"][0].removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    config["architectures"] = [("Gemma3Text" if family == "Gemma3" else family) + "ForSequenceClassification"]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    config["pad_token_id"] = None
    (dst / "config.json").write_text(json.dumps(config))
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights |= load_file(f)
    for head in ("lm_head.weight", "embed_out.weight"):  # GPT-NeoX's is saved as embed_out
        weights.pop(head, None)
    weights.pop("lm_head.bias", None)  # Phi's
    # GPT-2 names it n_embd; OPT-350m's score takes the projected-out width
    hidden = config.get("word_embed_proj_dim", config.get("hidden_size", config.get("n_embd")))
    head = "classifier.weight" if family == "CTRL" else "score.weight"  # CTRL names its head `classifier`
    weights[head] = torch.randn(num_labels, hidden, generator=torch.Generator().manual_seed(num_labels))
    save_file(weights, dst / "model.safetensors")
    return dst


def hf_label_logits(model_dir: pathlib.Path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32,
                                                               **hf_attention(model_dir)).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.fixture(scope="module")
def classifiers(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return lambda kind, num_labels: classifier_dir(model_dir(kind), root / f"{kind}-{num_labels}", num_labels)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "mistral", "qwen3-moe", "gemma2", "gemma", "phi3", "phi",
                                  "gpt-neox", "stablelm", "starcoder2", "glm4", "gpt2", "deepseek-v3", "olmo",
                                  "falcon", "gptj", "gpt-bigcode", "exaone4", "seed-oss",
                                  "helium", "arcee", "nemotron", "hunyuan", "hunyuan-moe", "opt", "opt-350m", "gpt-neo",
                                  "persimmon", "ctrl", "openai-gpt"])
def test_classify_matches_transformers(kind, classifiers, report_logit_diff):
    d = classifiers(kind, 3)
    ref = hf_label_logits(d, PROMPTS)
    # A 64-token budget splits the prompts over several batches.
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=64)
    logits = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])
    probs = llm.classify(PROMPTS)
    assert [o.prompt_token_ids for o in probs] == PROMPTS
    worst = (logits - ref).abs().max().item()
    report_logit_diff(f"{kind}, classifier logits (max |diff|)", worst)
    assert worst < ATOL, f"max |logit diff| {worst:.2e}"
    assert torch.allclose(torch.tensor([o.outputs.probs for o in probs]), ref.softmax(-1), atol=ATOL)


def test_score_is_a_cross_encoder(classifiers):
    d = classifiers("qwen3", 1)
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    query, docs = "What is the capital of France?", ["Paris is its capital.", "Bananas are yellow.", "France"]
    pairs = [llm.tokenizer(query, doc)["input_ids"] for doc in docs]
    ref = hf_label_logits(d, pairs)[:, 0]
    one_to_many = llm.score(query, docs)
    assert [o.prompt_token_ids for o in one_to_many] == pairs
    assert torch.allclose(torch.tensor([o.outputs.score for o in one_to_many]), ref.sigmoid(), atol=ATOL)
    raw = llm.score([query] * 3, docs, use_activation=False)
    assert torch.allclose(torch.tensor([o.outputs.score for o in raw]), ref, atol=ATOL)
    # Token-id sides are joined as they are.
    ids = llm.score([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    assert [o.prompt_token_ids for o in ids] == [[5, 6, 7, 9, 10], [8, 11, 12, 13]]
    assert torch.allclose(torch.tensor([o.outputs.score for o in ids]),
                          hf_label_logits(d, [[5, 6, 7, 9, 10], [8, 11, 12, 13]])[:, 0].sigmoid(), atol=ATOL)
    # A single label: classify's activation is the sigmoid too.
    assert llm.classify([pairs[0]])[0].outputs.probs[0] == pytest.approx(one_to_many[0].outputs.score, abs=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen3-swa", "phi3"])
def test_causal_embeddings_match_transformers(kind, model_dir):
    d = model_dir(kind)
    model = load_hf_model(d)
    with torch.inference_mode():  # the cached reference may hold inference tensors (phi3 longrope updates them)
        states = [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=64)
    for pooling, pool in (("mean", lambda h: h.mean(0)), ("last", lambda h: h[-1])):
        for out, h in zip(llm.embed(PROMPTS, pooling=pooling, causal=True), states):
            assert torch.allclose(torch.tensor(out.outputs.embedding), pool(h), atol=ATOL), pooling
    normalized = llm.embed(PROMPTS[:2], pooling="last", normalize=True, causal=True)
    for out, h in zip(normalized, states):
        assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(h[-1], dim=0), atol=ATOL)


def test_pooling_errors_leave_the_engine_usable(classifiers, qwen3_dir):
    d = classifiers("qwen3", 3)
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    before = [o.outputs.probs for o in llm.classify(PROMPTS[:2])]
    for call, error, match in [
            (lambda: llm.generate([[1, 2]], SamplingParams(max_tokens=2)), ValueError, f"{d}.*classify"),
            (lambda: llm.score("a", "b"), ValueError, "num_labels=3"),
            (lambda: llm.classify([[1, 2]], use_activation="yes"), TypeError, "use_activation"),
            (lambda: llm.classify([list(range(5, 80))]), ValueError, "max_model_len"),
            (lambda: llm.embed([[1, 2]], causal=1), TypeError, "causal")]:
        with pytest.raises(error, match=match):
            call()
    assert [o.outputs.probs for o in llm.classify(PROMPTS[:2])] == before
    lm = LLM(str(qwen3_dir), device="cpu", dtype="float32", max_model_len=64)
    for call, match in [(lambda: lm.classify([[1, 2]]), f"classify needs.*{qwen3_dir}"),
                        (lambda: lm.score("a", "b"), "score needs"),
                        (lambda: lm.score(["a", "b"], ["c", "d", "e"]), "data_1 has 2 prompts and data_2 3")]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_classify_and_causal_embed_on_cuda(backend, classifiers, llama_dir, ieee_fp32_matmul):
    """fp32 on the GPU (no TF32) against transformers in fp32 on the CPU; the GPU runs reductions in other orders."""
    d = classifiers("mistral", 3)
    with LLM(str(d), device="cuda", dtype="float32", attention_backend=backend, max_model_len=64) as llm:
        logits = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])
    assert (logits - hf_label_logits(d, PROMPTS)).abs().max().item() < 2e-4
    model = load_hf_model(llama_dir)
    with torch.no_grad():
        states = [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    with LLM(str(llama_dir), device="cuda", dtype="float32", attention_backend=backend, max_model_len=64,
             num_kvcache_blocks=8) as llm:
        for out, h in zip(llm.embed(PROMPTS, pooling="last", causal=True), states):
            assert torch.allclose(torch.tensor(out.outputs.embedding), h[-1], atol=2e-4)
