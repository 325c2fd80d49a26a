"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa: nanoinfer/models/bert.py; ModernBERT: models/modernbert.py):
LLM.embed, classify and score against transformers' `<Family>Model` and `<Family>ForSequenceClassification` on the
same weights (tests/models.py's build_encoder), the pooling a sentence-transformers config asks for, tensor
parallelism, and what is refused."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from models import (ENCODER_KINDS, ENCODER_MAX_POSITIONS, MODERNBERT_LOCAL_ATTENTION, MODERNBERT_ROPE_THETAS,
                    build_encoder, load_hf_encoder, random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.beam_search import BeamSearchParams

# Lengths 1 to 70 over the whole vocabulary (specials too: RoBERTa's pad id 1 inside a prompt counts no position),
# one prompt of pads between other tokens, and a one-token prompt.
PROMPTS = random_prompts(6, 0, 512, 1, 70, seed=31) + [[0, 5, 1, 1, 9, 2], [42]]
ENGINE = dict(device="cpu", dtype="float32")
TOL = dict(rtol=1e-5, atol=1e-5)
POOL = {"cls": lambda h: h[0], "mean": lambda h: h.mean(0), "last": lambda h: h[-1]}
QUERY, DOCS = "What is the capital of France?", ["Paris is the capital of France.", "Bananas are yellow.", "fox"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """encoder(kind, num_labels=None) -> the directory of build_encoder's model (built once per module)."""
    root = tmp_path_factory.mktemp("encoders")

    def get(kind: str, num_labels: int | None = None) -> Path:
        d = root / f"{kind}-{num_labels}"
        return d if d.exists() else build_encoder(kind, d, num_labels)

    return get


@torch.no_grad()
def hf_states(model_dir: Path, ids: list[int], token_types: list[int] | None = None) -> torch.Tensor:
    """transformers' last hidden states [len, hidden] (a classifier's: its encoder's)."""
    model = load_hf_encoder(model_dir)
    encoder = getattr(model, "base_model", model)
    kwargs = {} if token_types is None else {"token_type_ids": torch.tensor([token_types])}
    return encoder(torch.tensor([ids]), **kwargs).last_hidden_state[0]


@torch.no_grad()
def hf_logits(model_dir: Path, ids: list[int], token_types: list[int] | None = None) -> torch.Tensor:
    kwargs = {} if token_types is None else {"token_type_ids": torch.tensor([token_types])}
    return load_hf_encoder(model_dir)(torch.tensor([ids]), **kwargs).logits[0]


def pair_types(first: list[int], second: list[int]) -> list[int]:
    return [0] * len(first) + [1] * len(second)


@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_embeddings_match_transformers(kind, encoder, report_logit_diff):
    """Every pooling, normalized or not, with the prompts packed in one pass and spread over several."""
    d = encoder(kind)
    refs = [hf_states(d, p) for p in PROMPTS]
    worst = 0.0
    for budget in (None, 100):  # one pass; several (a 100-token budget)
        llm = LLM(str(d), **ENGINE, max_num_batched_tokens=budget)
        for pooling, pool in POOL.items():
            outputs = llm.embed(PROMPTS, pooling=pooling)
            assert [o.prompt_token_ids for o in outputs] == PROMPTS
            for out, h in zip(outputs, refs):
                ours = torch.tensor(out.outputs.embedding)
                assert_close(ours, pool(h), **TOL, msg=lambda m: f"{pooling}, budget {budget}: {m}")
                worst = max(worst, (ours - pool(h)).abs().max().item())
        normalized = llm.embed(PROMPTS, pooling="cls", normalize=True)
        for out, h in zip(normalized, refs):
            assert_close(torch.tensor(out.outputs.embedding), F.normalize(h[0], dim=0), **TOL)
        llm.close()
    report_logit_diff(f"{kind} encoder, embeddings (max |diff|)", worst)


def test_embed_strings_and_the_position_limit(encoder):
    """Text goes through the tokenizer ([CLS] ... [SEP]); RoBERTa's first position is pad_token_id + 1, so its
    tables of ENCODER_MAX_POSITIONS + 2 rows hold prompts of ENCODER_MAX_POSITIONS tokens."""
    d = encoder("bert")
    llm = LLM(str(d), **ENGINE)
    out = llm.embed("The quick brown fox", pooling="mean")[0]
    assert out.prompt_token_ids == llm.tokenizer("The quick brown fox")["input_ids"] and out.prompt_token_ids[0] == 2
    assert_close(torch.tensor(out.outputs.embedding), hf_states(d, out.prompt_token_ids).mean(0), **TOL)
    for kind in ("bert", "roberta"):
        llm = LLM(str(encoder(kind)), **ENGINE)
        assert llm.llm_engine.config.max_model_len == ENCODER_MAX_POSITIONS
        longest = random_prompts(1, 5, 512, ENCODER_MAX_POSITIONS, ENCODER_MAX_POSITIONS, seed=3)[0]
        assert_close(torch.tensor(llm.embed([longest], pooling="last")[0].outputs.embedding),
                     hf_states(encoder(kind), longest)[-1], **TOL)
    with pytest.raises(ValueError, match=f"{ENCODER_MAX_POSITIONS} positions"):
        LLM(str(encoder("roberta")), **ENGINE, max_model_len=ENCODER_MAX_POSITIONS + 1)


@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_classify_matches_transformers(kind, encoder, report_logit_diff):
    """BERT's pooler + classifier and RoBERTa's classification head, on the first token, over several passes."""
    d = encoder(kind, 3)
    ref = torch.stack([hf_logits(d, p) for p in PROMPTS])
    llm = LLM(str(d), **ENGINE, max_num_batched_tokens=100)
    logits = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])
    report_logit_diff(f"{kind} encoder, classifier logits (max |diff|)", (logits - ref).abs().max().item())
    assert_close(logits, ref, **TOL)
    probs = llm.classify(PROMPTS)
    assert [o.prompt_token_ids for o in probs] == PROMPTS
    assert_close(torch.tensor([o.outputs.probs for o in probs]), ref.softmax(-1), **TOL)
    # A classifier embeds too: its encoder's hidden states.
    assert_close(torch.tensor(llm.embed(PROMPTS[:1], pooling="cls", normalize=False)[0].outputs.embedding),
                 hf_states(d, PROMPTS[0])[0], **TOL)


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "modernbert"])
def test_score_is_a_cross_encoder(kind, encoder, report_logit_diff):
    """Two texts through the tokenizer's pair encoding (BERT's with token types 0 and 1), token-id pairs joined
    (BERT: the first side type 0, the second type 1); one-to-many and pairwise."""
    d = encoder(kind, 1)
    bert = kind == "bert"
    llm = LLM(str(d), **ENGINE)
    encodings = [llm.tokenizer(QUERY, doc) for doc in DOCS]
    ref = torch.stack([hf_logits(d, e["input_ids"], e["token_type_ids"] if bert else None)[0] for e in encodings])
    scores = llm.score(QUERY, DOCS)
    assert [o.prompt_token_ids for o in scores] == [e["input_ids"] for e in encodings]
    assert_close(torch.tensor([o.outputs.score for o in scores]), ref.sigmoid(), **TOL)
    raw = llm.score([QUERY] * len(DOCS), DOCS, use_activation=False)
    assert_close(torch.tensor([o.outputs.score for o in raw]), ref, **TOL)
    firsts, seconds = PROMPTS[:3], [PROMPTS[3][:20], PROMPTS[4][:20], [7]]
    ids_ref = torch.stack([hf_logits(d, a + b, pair_types(a, b) if bert else None)[0]
                           for a, b in zip(firsts, seconds)])
    ids = llm.score(firsts, seconds, use_activation=False)
    assert [o.prompt_token_ids for o in ids] == [a + b for a, b in zip(firsts, seconds)]
    assert_close(torch.tensor([o.outputs.score for o in ids]), ids_ref, **TOL)
    ours = torch.tensor([o.outputs.score for o in raw + ids])
    report_logit_diff(f"{kind} encoder, cross-encoder logits (max |diff|)",
                      (ours - torch.cat([ref, ids_ref])).abs().max().item())
    if bert:  # the token types matter: without them transformers scores otherwise
        untyped = torch.stack([hf_logits(d, e["input_ids"])[0] for e in encodings])
        assert (untyped - ref).abs().min().item() > 1e-3


def with_pooling_config(src: Path, dst: Path, modes: dict[str, bool] | None, normalize: bool = True) -> Path:
    """src with a sentence-transformers config: modules.json (Transformer, Pooling at 1_Pooling, and Normalize if
    asked) and 1_Pooling/config.json of `modes` (None: no sentence-transformers files)."""
    shutil.copytree(src, dst)
    if modes is None:
        return dst
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    modules = modules if normalize else modules[:2]
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False} | modes
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("modes, pooling", [
    ({"pooling_mode_cls_token": True}, "cls"), ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"), (None, "mean")])
def test_default_pooling_is_the_sentence_transformers_one(modes, pooling, encoder, tmp_path):
    """The config's pooling, L2-normalised as its Normalize module asks (not without a config)."""
    d = with_pooling_config(encoder("bert"), tmp_path / "st", modes)
    llm = LLM(str(d), **ENGINE)
    embeddings = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS)])
    expected = torch.stack([POOL[pooling](hf_states(d, p)) for p in PROMPTS])
    assert_close(embeddings, expected if modes is None else F.normalize(expected, dim=-1), **TOL)
    others = [p for p in POOL if p != pooling]  # the default is not one of them
    for other in others:
        assert (torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, pooling=other, normalize=modes is not None)])
                - embeddings).abs().max().item() > 1e-2


def test_default_normalization_is_the_sentence_transformers_one(encoder, tmp_path):
    """Without a Normalize module the default is the raw pooled vector; normalize given explicitly wins either way."""
    cls = {"pooling_mode_cls_token": True}
    raw = torch.stack([hf_states(encoder("bert"), p)[0] for p in PROMPTS])
    for normalize_module in (False, True):
        d = with_pooling_config(encoder("bert"), tmp_path / str(normalize_module), cls, normalize_module)
        llm = LLM(str(d), **ENGINE)
        for normalize in (None, False, True):
            got = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, normalize=normalize)])
            normalized = normalize_module if normalize is None else normalize
            assert_close(got, F.normalize(raw, dim=-1) if normalized else raw, **TOL)


def test_unsupported_sentence_transformers_pooling_is_refused(encoder, tmp_path):
    """Max pooling, two modes at once: refused when embed is left to the model's pooling, naming the file; a pooling
    given explicitly still runs."""
    for name, modes in (("max", {"pooling_mode_max_tokens": True}),
                        ("two", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})):
        d = with_pooling_config(encoder("bert"), tmp_path / name, modes)
        llm = LLM(str(d), **ENGINE)
        with pytest.raises(ValueError, match=f"{d / '1_Pooling' / 'config.json'}.*pooling="):
            llm.embed(PROMPTS[:1])
        assert_close(torch.tensor(llm.embed(PROMPTS[:1], pooling="cls", normalize=False)[0].outputs.embedding),
                     hf_states(d, PROMPTS[0])[0], **TOL)


def test_decoder_default_pooling_is_unchanged(qwen3_dir):
    llm = LLM(str(qwen3_dir), **ENGINE, max_model_len=128)
    default = [o.outputs.embedding for o in llm.embed(PROMPTS[:2])]
    assert default == [o.outputs.embedding for o in llm.embed(PROMPTS[:2], pooling="mean")]
    # "cls" works on a decoder too: its first token.
    assert [o.outputs.embedding for o in llm.embed(PROMPTS[:2], pooling="cls")] != default


@pytest.mark.parametrize("num_labels", [None, 1])
def test_generation_and_bad_calls_are_refused(num_labels, encoder):
    """generate, chat, beam_search, generate_iter and the step API name the model and its architecture; a bad
    pooling, causal=True and a prompt over max_model_len are refused; the engine then pools as before. The KV
    cache is one sequence's (never written)."""
    d = encoder("bert", num_labels)
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    llm = LLM(str(d), **ENGINE)
    runner = llm.llm_engine.model_runner
    assert runner.num_kvcache_blocks == math.ceil(ENCODER_MAX_POSITIONS / runner.block_size)
    assert runner.graph_runner is None
    before = [o.outputs.embedding for o in llm.embed(PROMPTS[:3], pooling="cls")]
    params = SamplingParams(max_tokens=2)
    refused = f"{d} is an? [a-z-]+ model \\({arch}\\) and does not generate"
    for call, error, match in [
            (lambda: llm.generate([[5, 6]], params), ValueError, refused),
            (lambda: llm.chat([{"role": "user", "content": "hi"}], params), ValueError, refused),
            (lambda: llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2)), ValueError, refused),
            (lambda: next(llm.generate_iter([[5, 6]], params)), ValueError, refused),
            (lambda: llm.llm_engine.add_request("r", [5, 6], params), ValueError, refused),
            (lambda: llm.embed([[5, 6]], pooling="max"), ValueError, "pooling must be"),
            (lambda: llm.embed([[5, 6]], causal=True), ValueError, f"causal=True.*{arch}"),
            (lambda: llm.embed([list(range(5, 5 + ENCODER_MAX_POSITIONS + 1))]), ValueError, "max_model_len")]:
        with pytest.raises(error, match=match):
            call()
    assert [o.outputs.embedding for o in llm.embed(PROMPTS[:3], pooling="cls")] == before
    if num_labels is None:
        with pytest.raises(ValueError, match="classify needs"):
            llm.classify([[5, 6]])


def test_relative_positions_are_refused(encoder, tmp_path):
    d = tmp_path / "relative"
    shutil.copytree(encoder("bert"), d)
    config = json.loads((d / "config.json").read_text()) | {"position_embedding_type": "relative_key"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        LLM(str(d), **ENGINE)


def with_config(src: Path, dst: Path, changes: dict, removed: tuple[str, ...] = ()) -> Path:
    """A copy of src whose config.json has `changes` and lacks `removed`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in removed}))
    return dst


def test_modernbert_local_windows_and_rope_thetas(encoder, tmp_path):
    """The test model's prompts outgrow its local window, and its local layers' rope theta is far from its global
    ones': transformers' states change by far more than the tolerance with the window lifted or one theta for
    every layer, so test_embeddings_match_transformers sees both."""
    d, prompt = encoder("modernbert"), PROMPTS[1]
    assert len(prompt) > MODERNBERT_LOCAL_ATTENTION
    config = load_hf_encoder(d).config
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert {t: p["rope_theta"] for t, p in config.rope_parameters.items()} == {
        "full_attention": MODERNBERT_ROPE_THETAS["global_rope_theta"],
        "sliding_attention": MODERNBERT_ROPE_THETAS["local_rope_theta"]}
    ref = hf_states(d, prompt)
    theta = MODERNBERT_ROPE_THETAS["global_rope_theta"]
    one_theta = {"rope_parameters": {t: {"rope_type": "default", "rope_theta": theta} for t in config.rope_parameters}}
    for name, changes in (("no window", {"local_attention": 1000}), ("one theta", one_theta)):
        assert (hf_states(with_config(d, tmp_path / name, changes), prompt) - ref).abs().max().item() > 1e-2, name


def test_modernbert_hub_config_and_cls_pooling(encoder, tmp_path):
    """A config in the Hub's form (global_attn_every_n_layers, global_rope_theta, local_rope_theta: transformers 5
    derives layer_types and rope_parameters from them) embeds alike; a classifier with classifier_pooling "cls"
    reads the first token (the test classifier's is "mean": test_classify_matches_transformers); a
    sentence-transformers config gives the default pooling (mean, normalized, as the released embedders')."""
    legacy = with_config(encoder("modernbert"), tmp_path / "hub", {"global_attn_every_n_layers": 3,
                         **MODERNBERT_ROPE_THETAS}, removed=("layer_types", "rope_parameters"))
    with LLM(str(legacy), **ENGINE) as llm:
        embeddings = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, pooling="mean")])
    assert_close(embeddings, torch.stack([hf_states(encoder("modernbert"), p).mean(0) for p in PROMPTS]), **TOL)
    cls = with_config(encoder("modernbert", 3), tmp_path / "cls", {"classifier_pooling": "cls"})
    with LLM(str(cls), **ENGINE) as llm:
        logits = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_activation=False)])
    ref = torch.stack([hf_logits(cls, p) for p in PROMPTS])
    assert_close(logits, ref, **TOL)
    assert (ref - torch.stack([hf_logits(encoder("modernbert", 3), p) for p in PROMPTS])).abs().max() > 1e-2
    st = with_pooling_config(encoder("modernbert"), tmp_path / "st", {"pooling_mode_mean_tokens": True})
    with LLM(str(st), **ENGINE) as llm:
        embeddings = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS)])
    assert_close(embeddings, F.normalize(torch.stack([hf_states(st, p).mean(0) for p in PROMPTS]), dim=-1), **TOL)
    with pytest.raises(ValueError, match="classifier_pooling.*max"):  # transformers 5.23 refuses it first
        LLM(str(with_config(encoder("modernbert", 3), tmp_path / "max", {"classifier_pooling": "max"})), **ENGINE)


@pytest.mark.slow
def test_tensor_parallel_2_matches_tp1_and_transformers(encoder):
    """BERT under TP=2 (gloo, a spawned worker): embeddings and cross-encoder scores (text pairs with token types,
    token-id pairs) equal TP=1 and transformers."""
    embedder, cross_encoder = encoder("bert"), encoder("bert", 1)
    firsts, seconds = PROMPTS[:3], [PROMPTS[3][:20], PROMPTS[4][:20], [7]]
    results = []
    for tp in (1, 2):
        with LLM(str(embedder), **ENGINE, tensor_parallel_size=tp, max_num_batched_tokens=100) as llm:
            embeddings = {p: torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, pooling=p)])
                          for p in POOL}
        with LLM(str(cross_encoder), **ENGINE, tensor_parallel_size=tp) as llm:
            scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_activation=False)
                                   + llm.score(firsts, seconds, use_activation=False)])
            encodings = [llm.tokenizer(QUERY, doc) for doc in DOCS]
        results.append((embeddings, scores))
    (tp1_embeddings, tp1_scores), (tp2_embeddings, tp2_scores) = results
    for pooling, pool in POOL.items():
        assert_close(tp2_embeddings[pooling], tp1_embeddings[pooling], **TOL)
        assert_close(tp2_embeddings[pooling], torch.stack([pool(hf_states(embedder, p)) for p in PROMPTS]), **TOL)
    ref = [hf_logits(cross_encoder, e["input_ids"], e["token_type_ids"])[0] for e in encodings]
    ref += [hf_logits(cross_encoder, a + b, pair_types(a, b))[0] for a, b in zip(firsts, seconds)]
    assert_close(tp2_scores, tp1_scores, **TOL)
    assert_close(tp2_scores, torch.stack(ref), **TOL)


@pytest.mark.slow
def test_modernbert_tensor_parallel_2_matches_tp1_and_transformers(encoder):
    """ModernBERT under TP=2 (each rank half the heads of the fused Wqkv and half of each GeGLU half of Wi): mean and
    cls embeddings over several passes and a mean-pooling cross-encoder's scores equal TP=1 and transformers."""
    embedder, cross_encoder = encoder("modernbert"), encoder("modernbert", 1)
    firsts, seconds = PROMPTS[:3], [PROMPTS[3][:20], PROMPTS[4][:20], [7]]
    results = []
    for tp in (1, 2):
        with LLM(str(embedder), **ENGINE, tensor_parallel_size=tp, max_num_batched_tokens=100) as llm:
            embeddings = [torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, pooling=p)])
                          for p in ("mean", "cls")]
        with LLM(str(cross_encoder), **ENGINE, tensor_parallel_size=tp) as llm:
            scores = torch.tensor([o.outputs.score for o in llm.score(firsts, seconds, use_activation=False)])
        results.append((*embeddings, scores))
    refs = [torch.stack([hf_states(embedder, p).mean(0) for p in PROMPTS]),
            torch.stack([hf_states(embedder, p)[0] for p in PROMPTS]),
            torch.stack([hf_logits(cross_encoder, a + b)[0] for a, b in zip(firsts, seconds)])]
    for tp1, tp2, ref in zip(*results, refs):
        assert_close(tp2, tp1, **TOL)
        assert_close(tp2, ref, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_encoders_on_cuda(backend, encoder, ieee_fp32_matmul):
    """fp32 on the GPU (no TF32) against transformers in fp32 on the CPU: BERT (token types), RoBERTa (positions
    from pad + 1) and ModernBERT (local windows on both sides, two rope thetas) cross-encoders' scores and their
    encoders' mean-pooled states."""
    for kind in ("bert", "roberta", "modernbert"):
        d = encoder(kind, 1)
        with LLM(str(d), device="cuda", dtype="float32", attention_backend=backend) as llm:
            scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_activation=False)])
            embeddings = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, pooling="mean")])
            encodings = [llm.tokenizer(QUERY, doc) for doc in DOCS]
        ref = [hf_logits(d, e["input_ids"], e.get("token_type_ids"))[0] for e in encodings]
        assert_close(scores, torch.stack(ref), rtol=0, atol=2e-4)
        assert_close(embeddings, torch.stack([hf_states(d, p).mean(0) for p in PROMPTS]), rtol=0, atol=2e-4)
