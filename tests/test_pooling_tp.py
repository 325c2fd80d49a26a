"""LLM.embed, classify and score under tensor parallelism (gloo, 2 ranks, a spawned worker): equal to TP=1 and to
transformers; a bad call leaves the engine usable (generation too); a worker that dies fails the pass and closes it.
The torchrun launch in test_tensor_parallel.py embeds too."""
import os
import signal
from pathlib import Path

import pytest
import torch

from models import hf_encoder_states, load_hf_model, random_prompts
from nanoinfer import LLM, SamplingParams
from test_classify import classifier_dir, hf_label_logits

pytestmark = pytest.mark.slow

# Lengths 1 to 40 (a one-token prompt too); a 64-token budget splits them over several passes.
PROMPTS = random_prompts(5, 5, 440, 2, 40, seed=29) + [[42]]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=64)
ATOL = 1e-4
KINDS = ("qwen3", "stablelm")  # RMSNorm and GQA; LayerNorms, partial rotary, per-head q/k norms, parallel residual


@pytest.fixture(scope="module")
def classifiers(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_classifiers")
    return lambda kind, num_labels: classifier_dir(model_dir(kind), root / f"{kind}-{num_labels}", num_labels)


def embeddings(model: Path, **engine) -> dict[tuple[str, bool], torch.Tensor]:
    """[prompts, hidden] per (pooling, causal)."""
    with LLM(str(model), **ENGINE, **engine) as llm:
        return {(pooling, causal): torch.tensor([o.outputs.embedding
                                                 for o in llm.embed(PROMPTS, pooling, causal=causal)])
                for pooling in ("mean", "last") for causal in (False, True)}


def hf_embeddings(model: Path) -> dict[tuple[str, bool], torch.Tensor]:
    """transformers' final-norm hidden states, as an encoder (see hf_encoder_states) and causal, pooled."""
    lm = load_hf_model(model)
    with torch.no_grad():
        causal = [lm.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    states = {False: [hf_encoder_states(model, p) for p in PROMPTS], True: causal}
    return {(pooling, c): torch.stack([h.mean(0) if pooling == "mean" else h[-1] for h in states[c]])
            for pooling in ("mean", "last") for c in (False, True)}


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_embed_matches_tp1_and_transformers(kind, model_dir, report_logit_diff):
    d = model_dir(kind)
    tp1, tp2, hf = embeddings(d), embeddings(d, tensor_parallel_size=2), hf_embeddings(d)
    worst = max((tp2[key] - hf[key]).abs().max().item() for key in hf)
    report_logit_diff(f"{kind}, embeddings with tensor parallel 2 (max |diff|)", worst)
    for key in hf:
        assert (tp2[key] - tp1[key]).abs().max().item() < ATOL, key
        assert (tp2[key] - hf[key]).abs().max().item() < ATOL, key


def label_logits(model: Path, **engine) -> torch.Tensor:
    with LLM(str(model), **ENGINE, **engine) as llm:
        return torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_classify_matches_tp1_and_transformers(kind, classifiers, report_logit_diff):
    """Logits and probabilities; refused calls (generate, score with 3 labels) leave the engine as it was."""
    d = classifiers(kind, 3)
    tp1, ref = label_logits(d), hf_label_logits(d, PROMPTS)
    with LLM(str(d), **ENGINE, tensor_parallel_size=2) as llm:
        logits = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])
        for call, match in [(lambda: llm.generate([[1, 2]], SamplingParams(max_tokens=2)), f"{d}.*classify"),
                            (lambda: llm.score("a", "b"), "num_labels=3")]:
            with pytest.raises(ValueError, match=match):
                call()
        probs = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS)])
    worst = (logits - ref).abs().max().item()
    report_logit_diff(f"{kind}, classifier logits with tensor parallel 2 (max |diff|)", worst)
    assert worst < ATOL
    assert (logits - tp1).abs().max().item() < ATOL
    assert (probs - ref.softmax(-1)).abs().max().item() < ATOL


def test_tp2_score_matches_tp1_and_transformers(classifiers):
    """One-to-many and pairwise, token ids joined and two texts through the tokenizer's pair encoding."""
    d = classifiers("qwen3", 1)
    pairs = [(a[:30], b[:30]) for a, b in zip(PROMPTS[:3], PROMPTS[3:6])]  # within max_model_len when joined
    query, docs = "What is the capital of France?", ["Paris is its capital.", "Bananas are yellow."]
    results = []
    for tp in (1, 2):
        with LLM(str(d), **ENGINE, tensor_parallel_size=tp) as llm:
            scores = [o.outputs.score for o in llm.score(*map(list, zip(*pairs)))]
            scores += [o.outputs.score for o in llm.score(pairs[0][0], [b for _, b in pairs])]
            scores += [o.outputs.score for o in llm.score(query, docs)]
            texts = [llm.tokenizer(query, doc)["input_ids"] for doc in docs]
        results.append(torch.tensor(scores))
    joined = [a + b for a, b in pairs] + [pairs[0][0] + b for _, b in pairs] + texts
    ref = hf_label_logits(d, joined)[:, 0].sigmoid()
    assert (results[1] - results[0]).abs().max().item() < ATOL
    assert (results[1] - ref).abs().max().item() < ATOL


def test_bad_pooling_calls_leave_the_tp_engine_usable(qwen3_dir):
    """Refused before any rank runs a pass: the same engine then embeds and generates as before (the worker went
    back to serving steps); a worker killed before a pass fails it, naming the worker, and closes the engine."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(qwen3_dir), **ENGINE) as llm:
        expected_tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(str(qwen3_dir), **ENGINE, tensor_parallel_size=2)
    embed = lambda: [o.outputs.embedding for o in llm.embed(PROMPTS[:3])]  # noqa: E731
    before = embed()
    for call, error, match in [(lambda: llm.embed([[1, 2], []]), ValueError, "empty"),
                               (lambda: llm.embed([list(range(5, 80))]), ValueError, "max_model_len"),
                               (lambda: llm.embed([[1, 2], [9999]]), ValueError, "vocabulary"),
                               (lambda: llm.embed([[1, 2]], pooling="max"), ValueError, "pooling"),
                               (lambda: llm.classify([[1, 2]]), ValueError, "classify needs"),
                               (lambda: llm.score("a", "b"), ValueError, "score needs")]:
        with pytest.raises(error, match=match):
            call()
    assert embed() == before
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected_tokens
    assert embed() == before
    worker = llm.llm_engine.tp.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        embed()
    with pytest.raises(RuntimeError, match="closed"):
        embed()
