"""DeepSeek-V2/V3 beyond the shared suites (greedy + logits: test_correctness.py; chunked prefill, prefix cache,
preemption at TP 1 and 2: test_moe.py; the Triton backend: triton_attention_interpreted.py): the routers against
transformers' own (GLM-4.5's too), the rope layouts, the MTP layers of V3's (and GLM-4.5's) checkpoints, the
latent cache's size and backends, MLA's split of a step (prefill over decompressed K/V, decodes absorbed), and
the settings refused by name; DeepSeek sparse attention's backends, indexer key cache and refused settings (dots3
note's, MiniMax-M3's and HY-V4's sparse attention too; DeepSeek-V4's compressed attention)."""
import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoinfer.layers.attention.mla as mla
import nanoinfer.layers.fused_moe as fused_moe
from models import DEEPSEEK_KINDS, NEWEST_FAMILIES, cached_hf_greedy, check_against_hf, make_config, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.layers.attention import Attention, AttentionMetadata, get_backend, selector
from nanoinfer.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2ForCausalLM, DeepseekV2MoE, MLAUpProjection
from nanoinfer.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(3, 5, 440, 5, 60, seed=51) + [[17]]
LOGIT_ATOL = 1e-4


def edited_copy(src, dst, weights: dict[str, torch.Tensor] | None = None, **changes):
    """src's model in dst with the config's `changes` (and, if given, these weights)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" or weights is None:
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    if weights is not None:
        save_file(weights, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS + ("glm4-moe",))
@torch.inference_mode()
def test_deepseek_routing_is_transformers_own(kind):
    """DeepSeek's routers (V2 softmax greedy / group-limited, V3 and GLM-4.5 sigmoid + correction bias in the best
    groups, renormalized) pick transformers' experts with transformers' weights; the group limit and the bias bind."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter

    config = make_config(kind)
    v3 = kind != "deepseek-v2" and kind != "deepseek-v2-group"
    torch.manual_seed(0)
    ref = {"deepseek-v3": DeepseekV3TopkRouter, "glm4-moe": Glm4MoeTopkRouter,
           "glm4-moe-lite": Glm4MoeLiteTopkRouter}.get(kind, DeepseekV2TopkRouter)(config)
    ref.weight.normal_(0, 0.2)
    ours = (DeepseekV3MoE if v3 else DeepseekV2MoE)(config)
    ours.gate.weight.copy_(ref.weight)
    if v3:
        ref.e_score_correction_bias.normal_(0, 0.3)
        ours.gate.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(500, config.hidden_size)
    _, ref_weights, ref_ids = ref(x)
    weights, ids = ours.select_experts(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    logits = x @ ref.weight.T
    plain = (logits.sigmoid() if v3 else logits.softmax(-1)).topk(config.num_experts_per_tok, -1)[1]
    changed = (plain.sort(-1).values != ids.sort(-1).values).any(-1).float().mean().item()
    if kind == "deepseek-v2":  # greedy: the plain top k
        assert changed == 0
    else:
        assert changed > 0.05, f"the groups (and V3's bias) change the choice of only {changed:.0%} of the tokens"


@pytest.mark.parametrize("kind, changes, tp, message", [
    ("deepseek-v2-group", {}, 3, r"tensor_parallel_size=3 does not divide the model's num_attention_heads \(4\)"),
    ("deepseek-v2-group", {"num_attention_heads": 2, "num_key_value_heads": 2, "moe_intermediate_size": 33}, 2,
     r"tensor_parallel_size=2 does not divide the model's moe_intermediate_size \(33\)"),
    ("deepseek-v2", {"num_key_value_heads": 2}, 1, r"num_key_value_heads=2 must equal num_attention_heads=4"),
    ("deepseek-v2", {"topk_method": "noaux_tc"}, 1, r"topk_method='noaux_tc' in the model config; expected one of"),
    ("deepseek-v2-group", {"n_group": 3}, 1, r"n_group=3 must be a positive int dividing n_routed_experts=8"),
    ("deepseek-v2-group", {"topk_group": 5}, 1, r"topk_group=5 must be an int between 1 and n_group=4"),
    ("deepseek-v3", {"n_group": None}, 1, r"n_group=None must be a positive int dividing n_routed_experts=8"),
])
def test_deepseek_settings_the_engine_cannot_run_are_refused_by_name(kind, changes, tp, message, monkeypatch):
    import nanoinfer.models.deepseek_v2 as deepseek_v2

    config = make_config(kind)
    for key, value in changes.items():
        setattr(config, key, value)
    monkeypatch.setattr(deepseek_v2, "tp_size", lambda: tp)
    monkeypatch.setattr(fused_moe, "tp_size", lambda: tp)
    with pytest.raises(ValueError, match=message):
        (DeepseekV3ForCausalLM if kind == "deepseek-v3" else deepseek_v2.DeepseekV2ForCausalLM)(config)


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm4-moe"])
def test_multi_token_prediction_layers_are_skipped(kind, model_dir, tmp_path, captured_logits):
    """DeepSeek-V3's and GLM-4.5's checkpoints carry `num_nextn_predict_layers` MTP layers numbered after the last
    decoder layer; plain decoding does not use them, so they load as nothing (a layer beyond those is a stray)."""
    d = model_dir(kind)
    weights = load_file(d / "model.safetensors")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in weights.items() if ".layers.2." in k}
    m = edited_copy(d, tmp_path / "mtp", {**weights, **mtp}, num_nextn_predict_layers=1)
    with LLM(str(m), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits) < LOGIT_ATOL
    stray = {"model.layers.4.input_layernorm.weight": torch.ones(64)}
    m = edited_copy(d, tmp_path / "stray", {**weights, **stray}, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="'model.layers.4.input_layernorm.weight'.* has no parameter"):
        LLM(str(m), device="cpu", dtype="float32", max_model_len=128)


def test_deepseek_v3_neox_rope_layout_matches_hf(model_dir, tmp_path, captured_logits, report_logit_diff):
    """`rope_interleave: false`: the rope halves (i, i + rope_dim / 2) rotate together, not the pairs (2i, 2i + 1)."""
    d = edited_copy(model_dir("deepseek-v3"), tmp_path / "neox", rope_interleave=False)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits)
    report_logit_diff("deepseek-v3, neox rope layout", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_cache_holds_the_latent_and_the_rope_key_once_per_token(model_dir, monkeypatch):
    """vLLM's MLA cache: per token and layer, kv_lora_rank + qk_rope_head_dim values (32 + 8 here) as one KV head,
    no V cache besides (V is a view of K's first kv_lora_rank entries); the blocks are sized by those bytes. The
    decompressed layout took 2 x 4 heads x 24 = 192 values per token and layer (x 85 for DeepSeek-V3)."""
    import nanoinfer.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_available_memory", lambda self: 4 << 20)
    with LLM(str(model_dir("deepseek-v2")), device="cpu", dtype="float32", max_model_len=64,
             max_num_seqs=64) as llm:
        assert llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.model_runner
        layers = [layer.self_attn.attn for layer in runner.model.model.layers]
        num_blocks = runner.num_kvcache_blocks
        values_per_block = len(layers) * 16 * (32 + 8)
        assert num_blocks == int((4 << 20) * model_runner.KV_CACHE_MEMORY_FRACTION) // (values_per_block * 4)
        storages = {}
        for a in layers:
            assert a.k_cache.shape == (num_blocks, 16, 1, 40) and a.v_cache.shape == (num_blocks, 16, 1, 32)
            assert a.v_cache.untyped_storage().data_ptr() == a.k_cache.untyped_storage().data_ptr()
            storages[a.k_cache.untyped_storage().data_ptr()] = a.k_cache.untyped_storage().nbytes()
        assert sum(storages.values()) == num_blocks * values_per_block * 4
        assert 0 < layers[0].k_cache[..., :32].abs().max().item()  # the prompt's latents were stored


@pytest.mark.parametrize("changes, sizes", [({"kv_lora_rank": 1024}, "1024 and 8"),
                                            ({"qk_rope_head_dim": 80}, "32 and 80")])
def test_triton_latent_cache_limits_are_checked_by_name(model_dir, tmp_path, monkeypatch, changes, sizes):
    """The Triton tiles take latents up to 512 and rope keys up to 64 (DeepSeek's): wider ones are refused when the
    engine is configured, not when a kernel fails to compile."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what a CPU device needs to accept the triton backend
    d = edited_copy(model_dir("deepseek-v2"), tmp_path / "wide", **changes)
    with pytest.raises(ValueError, match=f"runs MLA with kv_lora_rank <= 512 and qk_rope_head_dim <= 64, the model "
                                         f"has {sizes}"):
        Config(d, device="cpu", attention_backend="triton")


def test_latent_cache_goes_to_triton_not_flash_on_cuda(model_dir, monkeypatch):
    """flash-attn takes K and V of one head size (at most 256): with it installed, 'auto' picks the Triton backend
    for MLA, and asking for flash is refused by name."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine as far as Config looks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(selector, "flash_attn_available", lambda: True)
    d = model_dir("deepseek-v3")
    assert Config(d).attention_backend == "triton" and Config(model_dir("qwen3")).attention_backend == "flash"
    with pytest.raises(ValueError, match=r"flash-attn cannot run MLA's latent KV cache \(values a prefix of the "
                                         r"keys, 32 of 40\); use attention_backend='triton'"):
        Config(d, attention_backend="flash")


@dataclass
class MLALayer:
    """One MLA layer of ours and transformers' with the same random weights, over a paged cache of 16-token blocks
    (sequence s owns blocks 8s to 8s + 7)."""
    ours: DeepseekV2Attention
    hf: torch.nn.Module
    hf_rope: torch.nn.Module

    @classmethod
    def build(cls, kind: str, backend: str) -> "MLALayer":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

        config = make_config(kind)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        module = v3 if kind == "deepseek-v3" else v2
        prefix = "DeepseekV3" if kind == "deepseek-v3" else "DeepseekV2"
        hf = getattr(module, f"{prefix}Attention")(config, layer_idx=0).eval()
        for name, p in hf.named_parameters():  # unit-scale scores, so that the softmax is far from uniform
            p.data = 1 + 0.1 * torch.randn_like(p) if "layernorm" in name else 0.25 * torch.randn_like(p)
        model_class = DeepseekV3ForCausalLM if kind == "deepseek-v3" else DeepseekV2ForCausalLM
        ours = DeepseekV2Attention(config, model_class.attention_options(config, 0))
        hf_params = dict(hf.named_parameters())
        for name, p in ours.named_parameters():
            p.data.copy_(hf_params[name])
        ours.kv_b_proj.process_weights_after_loading(1)
        ours.attn.backend = get_backend(backend, torch.float32)
        ours.attn.allocate_cache(32, 16, torch.float32, torch.device("cpu"))
        return cls(ours, hf, getattr(module, f"{prefix}RotaryEmbedding")(config))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' causal attention over a whole sequence's hidden states x [len, hidden]."""
        n = x.shape[0]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = self.hf_rope(x[None], torch.arange(n)[None])
        return self.hf(hidden_states=x[None], position_embeddings=rope, attention_mask=mask)[0][0]

    def step(self, xs: dict[int, torch.Tensor], spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """Ours over one step: (sequence, first position, new tokens) per scheduled sequence, its hidden states
        from xs; the rows of every sequence's new tokens, in order."""
        tables = torch.tensor([[8 * s + j for j in range(8)] for s, _, _ in spans], dtype=torch.int32)
        pos = [torch.arange(start, start + n) for _, start, n in spans]
        slots = torch.cat([tables[i, p // 16].long() * 16 + p % 16 for i, p in enumerate(pos)])
        new = torch.tensor([n for _, _, n in spans])
        ctx = torch.tensor([start + n for _, start, n in spans])
        zero = torch.zeros(1, dtype=torch.int32)
        meta = AttentionMetadata(slots, tables, ctx.int(), torch.cat([zero, new.cumsum(0).int()]),
                                 torch.cat([zero, ctx.cumsum(0).int()]), int(new.max()), int(ctx.max()), 16,
                                 has_cached_prefix=bool((ctx > new).any()))
        self.ours.attn.backend.prepare(meta)
        x = torch.cat([xs[s][start:start + n] for s, start, n in spans])
        return self.ours(torch.cat(pos), x, meta)


# A mixed step: sequence 0 a fresh 20-token prompt, 1 a 36-token chunk after 40 cached tokens (decompressed with its
# prefix), 2 a decode after 50, 3 a 3-token chunk after 45 (absorbed: too short to pay for decompressing 48 keys).
CACHED = [(1, 0, 40), (2, 0, 50), (3, 0, 45)]
MIXED = [(0, 0, 20), (1, 40, 36), (2, 50, 1), (3, 45, 3)]


def mixed_step_against_hf_and_absorbed(kind: str, backend: str, monkeypatch) -> None:
    layer = MLALayer.build(kind, backend)
    torch.manual_seed(1)
    xs = {s: torch.randn(start + n, layer.ours.o_proj.weight.shape[0]) for s, start, n in MIXED}
    layer.step(xs, CACHED)
    ours = layer.step(xs, MIXED)
    ref = torch.cat([layer.reference(xs[s])[start:] for s, start, _ in MIXED])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(mla, "decompress_pays", lambda new, prefix, dims: np.zeros(new.shape, bool))
    absorbed = layer.step(xs, MIXED)
    torch.testing.assert_close(ours, absorbed, rtol=1e-5, atol=1e-5)
    assert (ours - absorbed).abs().max() > 0  # two computations, not one twice


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
@torch.inference_mode()
def test_mixed_mla_step_matches_transformers_and_the_absorbed_path(kind, monkeypatch):
    """A step of a fresh prompt, a chunk after a cached prefix, a decode and a short chunk: the prefill rows over
    decompressed K/V and the others absorbed give transformers' attention (V2: yarn's mscale in the scale) and what
    the all-absorbed path gives."""
    mixed_step_against_hf_and_absorbed(kind, "cpu", monkeypatch)


@torch.inference_mode()
def test_prefill_rows_are_decompressed_and_decode_rows_absorbed(monkeypatch):
    """Which rows take which path: kv_b_proj decompresses the prefill sequences' contexts (the cached prefix read
    back from the latent cache) and absorbs only the decode rows' queries; a decode-only step decompresses nothing."""
    layer = MLALayer.build("deepseek-v3", "cpu")
    calls = {"decompress": [], "absorb_query": []}
    for name, rows in calls.items():
        method = getattr(MLAUpProjection, name)
        monkeypatch.setattr(MLAUpProjection, name,
                            lambda self, t, method=method, rows=rows: rows.append(t.shape[0]) or method(self, t))
    torch.manual_seed(1)
    xs = {s: torch.randn(start + n + 1, layer.ours.o_proj.weight.shape[0]) for s, start, n in MIXED}
    layer.step(xs, CACHED)
    assert calls == {"decompress": [135], "absorb_query": []}
    layer.step(xs, MIXED)
    assert calls == {"decompress": [135, 20 + 76], "absorb_query": [1 + 3]}
    layer.step(xs, [(s, start + n, 1) for s, start, n in MIXED])
    assert calls == {"decompress": [135, 96], "absorb_query": [4, 4]}


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_prefix_hits_decompress_the_cached_prefix_and_match_hf(kind, model_dir, captured_logits, report_logit_diff,
                                                              monkeypatch):
    """The engine's prefix hits with tails long enough to go decompressed (36-40 tokens after 48 cached): the cached
    latents are read back and decompressed (a step with context slots), and the tokens and logits are
    transformers'."""
    d = model_dir(kind)
    reads = []
    context_slots = mla._context_slots
    monkeypatch.setattr(mla, "_context_slots", lambda *args: reads.append(1) or context_slots(*args))
    shared = random_prompts(1, 5, 440, 48, 48, seed=61)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 36, 40, seed=62)]
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=128) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 48 for o in second) and reads
    refs = cached_hf_greedy(d, prompts, MAX_TOKENS)
    worst = max(check_against_hf(first, refs[:1], captured_logits), check_against_hf(second, refs, captured_logits))
    report_logit_diff(f"{kind}, prefix hits over decompressed K/V", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def dsa_kind(kind: str) -> str:
    """kind, where the installed transformers has its family (5.17 lacks the DeepSeek sparse attention ones and
    Inkling)."""
    pytest.importorskip(f"transformers.models.{NEWEST_FAMILIES[kind]}", reason="the reference family is missing")
    return kind


@pytest.mark.parametrize("kind, architecture, attention", [
    ("deepseek-v32", "DeepseekV32ForCausalLM", "DeepSeek sparse attention"),
    ("hy-v4", "HYV4ForCausalLM", "DeepSeek sparse attention"),
    ("deepseek-v4", "DeepseekV4ForCausalLM", "compressed attention"),
    ("minimax-m3", "MiniMaxM3VLForCausalLM", "block-sparse attention"), ("qwen4-exp", "Qwen4ExpForCausalLM", "QSA"),
    ("kolibri1-1", "Kolibri1_1ForCausalLM", "indexed attention"),
    ("inkling", "InklingForCausalLM", "relative logits"), ("inkling2", "Inkling2ForCausalLM", "relative logits"),
    ("inkling2-loop", "Inkling2LoopForCausalLM", "relative logits")])
def test_sparse_attention_runs_on_the_pytorch_backend_only(kind, architecture, attention, model_dir, monkeypatch,
                                                           capsys):
    """No other backend selects keys per query (DeepSeek-V3.2, MiniMax-M3, Qwen4-Exp), pools earlier windows into keys of their
    own (DeepSeek-V4) or adds a bias per query and distance (Inkling): on a CUDA machine (as far as Config looks, flash-attn installed) 'auto' takes the PyTorch backend, saying
    so in one INFO line; 'triton' and 'flash' are refused by name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(selector, "flash_attn_available", lambda: True)
    d = model_dir(dsa_kind(kind))
    capsys.readouterr()
    assert Config(d).attention_backend == "cpu"
    assert capsys.readouterr().err.strip().endswith(
        f"attention: only the PyTorch backend runs {architecture}'s {attention}; using it (attention_backend='cpu')")
    for backend in ("triton", "flash"):
        with pytest.raises(ValueError, match=f"attention_backend='{backend}' cannot run {architecture}: only the "
                                             f"PyTorch backend runs its {attention}"):
            Config(d, attention_backend=backend)


@pytest.mark.parametrize("kind, kv_values, indexers", [("deepseek-v32", 3 * (32 + 8), 3),
                                                       ("glm-moe-dsa", 3 * (32 + 8), 2),
                                                       ("hy-v4", 3 * (32 + 8), 2),
                                                       ("dots3-note", 2 * (32 + 8) + 24 + 8, 2),
                                                       ("minimax-m3", 3 * 2 * (2 * 16), 2)])
def test_indexer_keys_are_cached_in_the_kv_blocks(kind, kv_values, indexers, model_dir, monkeypatch):
    """Every layer with an indexer (GLM's shared layer, dots3 note's sliding one and MiniMax-M3's full one have none)
    caches one index_head_dim key per token (16 here) in the KV cache's blocks beside its attention's (MLA's latent
    rows, 32 + 8, 24 + 8 on dots3 note's sliding layer; MiniMax-M3's K and V of 2 heads of 16): the blocks are sized
    by both, and the prompt's keys are stored."""
    import nanoinfer.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_available_memory", lambda self: 4 << 20)
    with LLM(str(model_dir(dsa_kind(kind))), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=64) as llm:
        assert llm.generate([list(range(5, 25))], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.model_runner
        caches = [layer.self_attn.indexer.cache for layer in runner.model.model.layers
                  if layer.self_attn.indexer is not None]
        num_blocks = runner.num_kvcache_blocks
        values_per_block = 16 * (kv_values + indexers * 16)
        assert len(caches) == indexers
        assert num_blocks == int((4 << 20) * model_runner.KV_CACHE_MEMORY_FRACTION) // (values_per_block * 4)
        for cache in caches:
            assert cache.k_cache.shape == (num_blocks, 16, 1, 16) and cache.k_cache.abs().max().item() > 0


def test_kolibri1_1_caches_the_keys_and_values_of_the_layers_that_compute_them(model_dir, monkeypatch):
    """Kolibri 1.1's layers 2 and 3 attend over layer 0's keys and values, projecting queries alone: the KV blocks
    hold layer 0's and layer 1's (K and V of 2 heads of 16 each) and no more."""
    import nanoinfer.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_available_memory", lambda self: 4 << 20)
    with LLM(str(model_dir(dsa_kind("kolibri1-1"))), device="cpu", dtype="float32", max_model_len=64) as llm:
        assert llm.generate([list(range(5, 25))], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.model_runner
        assert [type(layer.self_attn.attn).__name__ for layer in runner.model.model.layers[:2]] == ["IndexedKV",
                                                                                                "Attention"]
        assert not any(isinstance(m, Attention) for m in runner.model.model.layers[2:].modules())
        values_per_block = 16 * 2 * (2 * 2 * 16)
        assert runner.num_kvcache_blocks == int((4 << 20) * model_runner.KV_CACHE_MEMORY_FRACTION) // (
            values_per_block * 4)


def test_kolibri1_1_refuses_tensor_parallelism_that_leaves_rank_0_fewer_query_heads_than_its_indexer_reads():
    """Rank 0 selects every rank's keys with its first index_num_heads query heads (2 here), which 4 ranks would
    leave it 1 of."""
    from nanoinfer.models.kolibri1_1 import Kolibri1_1ForCausalLM
    from nanoinfer.utils.dist import tp_scope

    with tp_scope(0, 4, None), pytest.raises(ValueError, match=r"index_num_heads=2 in the model config: rank 0 "
                                                                r"selects every rank's keys with its own query heads, "
                                                                r"1 under tensor parallelism over 4 ranks"):
        Kolibri1_1ForCausalLM(make_config(dsa_kind("kolibri1-1")))


def test_deepseek_v4_compressor_rows_are_cached_in_the_kv_blocks(model_dir, monkeypatch):
    """Per token, every DeepSeek-V4 layer caches its shared K = V row (32 values) and each compressor its values and
    gates: the CSA layer's 2 x 2 x 32 and its indexer's 2 x 2 x 16, the HCA layer's 2 x 32. The blocks are sized by all
    of them, and the prompt's rows are stored."""
    import nanoinfer.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_available_memory", lambda self: 4 << 20)
    with LLM(str(model_dir(dsa_kind("deepseek-v4"))), device="cpu", dtype="float32", max_model_len=64) as llm:
        assert llm.generate([list(range(5, 25))], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.model_runner
        csa, hca = (layer.self_attn for layer in runner.model.model.layers[1:])
        caches = [csa.compressor.cache, csa.indexer.compressor.cache, hca.compressor.cache]
        num_blocks, values_per_block = runner.num_kvcache_blocks, 16 * (3 * 32 + 128 + 64 + 64)
        assert num_blocks == int((4 << 20) * model_runner.KV_CACHE_MEMORY_FRACTION) // (values_per_block * 4)
        for cache, width in zip(caches, (128, 64, 64)):
            assert cache.k_cache.shape == (num_blocks, 16, 1, width) and cache.k_cache.abs().max().item() > 0


def test_deepseek_v4_needs_no_compress_rate_for_a_layer_type_it_lacks():
    """transformers reads compress_rates only for the layer types the model has: one without CSA layers runs without
    CSA's rate, as there."""
    from nanoinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = make_config("deepseek-v4")
    config.layer_types = ["sliding_attention", "heavily_compressed_attention", "heavily_compressed_attention"]
    config.compress_rates = {"heavily_compressed_attention": 8}
    model = DeepseekV4ForCausalLM(config)
    assert [layer.self_attn.compressor.rate for layer in model.model.layers[1:]] == [8, 8]


def test_deepseek_v4_sinks_join_16_bit_scores_in_fp32():
    """transformers keeps DeepSeek-V4's sinks in fp32 (`_keep_in_fp32_modules_strict`) and its eager attention joins
    them to the bf16 scores unrounded: a layer built in bf16 keeps them fp32, and its attention rows equal
    transformers' exactly (with the sinks rounded to bf16 they differ by ~2e-3)."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4",
                                   reason="the reference family is missing")
    from nanoinfer.models.deepseek_v32 import sparse_rows
    from nanoinfer.models.deepseek_v4 import DeepseekV4Attention, DeepseekV4ForCausalLM

    config = make_config("deepseek-v4")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = DeepseekV4Attention(config, DeepseekV4ForCausalLM.attention_options(config, 1))
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    heads, dim, n, keys = layer.num_heads, layer.head_dim, 6, 9
    sinks = layer.attn.sinks
    assert sinks.dtype == torch.float32
    sinks.copy_(torch.randn(heads, generator=g) * 2)
    q, k = torch.randn(n, heads, dim, generator=g).bfloat16(), torch.randn(keys, 1, dim, generator=g).bfloat16()
    mask = torch.rand(n, keys, generator=g) < 0.7
    mask[:, 0] = True
    ours = sparse_rows(q, k, k, mask, layer.attn.scale, sinks).view(n, heads, dim)
    module = type("Module", (), {"num_key_value_groups": heads, "sinks": sinks, "training": False})
    bias = torch.zeros(n, keys, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    kv = k.transpose(0, 1)[None]
    theirs = modeling.eager_attention_forward(module, q.transpose(0, 1)[None], kv, kv, bias[None, None], layer.attn.scale)[0]
    torch.testing.assert_close(ours, theirs[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind, changes, message", [
    ("deepseek-v32", {"q_lora_rank": 0}, r"q_lora_rank=0 in the model config: DeepSeek sparse attention's "
                                         r"indexer reads the query's low-rank latent"),
    ("deepseek-v32", {"index_head_dim": 4}, r"index_head_dim=4 in the model config: the indexer ropes its first "
                                            r"qk_rope_head_dim=8 dims"),
    ("deepseek-v32", {"index_topk": 0}, r"index_topk=0 in the model config; expected a positive int"),
    ("glm-moe-dsa", {"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\]='shared' in the model config"),
    ("glm-moe-dsa", {"indexer_types": ["full", "sparse", "full"]}, r"indexer_types\[1\]='sparse' in the model config"),
    ("axk2", {"n_group": 4, "topk_group": 2}, r"n_group=4 in the model config: A.X-K2's grouped routing is not "
                                              r"supported"),
    ("dots3-note", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     r"layer_types\[1\]='full_attention' in the model config is not supported"),
    ("dots3-note", {"rope_parameters": {"indexed_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e3,
                                                              "factor": 2.0}}},
     r"rope_type='linear' of the sliding_attention layers in the model config is not supported"),
    ("dots3-note", {"mlp_bias": True}, r"mlp_bias=True in the model config is not supported"),
    ("hy-v4", {"swiglu_limit": 0.0}, r"swiglu_limit=0.0 in the model config is not supported; expected > 0"),
    ("hy-v4", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     r"layer_types\[1\]='full_attention' in the model config is not supported; expected one of "
     r"\('indexed_attention', 'deepseek_sparse_attention'\)"),
    ("hy-v4", {"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\]='shared' in the model config"),
    ("deepseek-v4", {"mlp_layer_types": ["hash_moe", "dense", "moe"]},
     r"mlp_layer_types\[1\]='dense' in the model config is not supported; expected one of \('hash_moe', 'moe'\)"),
    ("deepseek-v4", {"scoring_func": "softmax"}, r"scoring_func='softmax' in the model config is not supported"),
    ("deepseek-v4", {"swiglu_limit": -1.0}, r"swiglu_limit=-1.0 in the model config is not supported; expected > 0"),
    ("deepseek-v4", {"mlp_bias": True}, r"mlp_bias=True in the model config is not supported"),
    ("deepseek-v4", {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 0}},
     r"compress_rates\['heavily_compressed_attention'\]=0 in the model config; expected a positive int"),
    ("deepseek-v4", {"o_groups": 3}, r"o_groups=3 in the model config must divide num_attention_heads=4"),
    ("minimax-m3", {"layer_types": ["full_attention", "sliding_attention", "minimax_m3_sparse"]},
     r"layer_types\[1\]='sliding_attention' in the model config is not supported"),
    ("minimax-m3", {"index_n_heads": 4}, r"index_n_heads=4 in the model config must equal num_key_value_heads=2"),
    ("minimax-m3", {"index_head_dim": 4}, r"index_head_dim=4 in the model config is narrower than the rope's 8 dims"),
    ("minimax-m3", {"index_local_blocks": 4}, r"index_local_blocks=4 in the model config must be between 0 and "
                                              r"index_topk_blocks=3"),
])
def test_sparse_attention_settings_the_engine_cannot_run_are_refused_by_name(kind, changes, message):
    from nanoinfer.models.axk2 import AXK2ForCausalLM
    from nanoinfer.models.deepseek_v32 import DeepseekV32ForCausalLM
    from nanoinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from nanoinfer.models.dots3_note import Dots3NoteForCausalLM
    from nanoinfer.models.glm_moe_dsa import GlmMoeDsaForCausalLM
    from nanoinfer.models.hy_v4 import HYV4ForCausalLM
    from nanoinfer.models.minimax_m3 import MiniMaxM3VLForCausalLM

    config = make_config(dsa_kind(kind))
    for key, value in changes.items():
        setattr(config, key, value)
    model_class = {"deepseek-v32": DeepseekV32ForCausalLM, "glm-moe-dsa": GlmMoeDsaForCausalLM,
                   "axk2": AXK2ForCausalLM, "dots3-note": Dots3NoteForCausalLM, "hy-v4": HYV4ForCausalLM,
                   "minimax-m3": MiniMaxM3VLForCausalLM, "deepseek-v4": DeepseekV4ForCausalLM}[kind]
    with pytest.raises(ValueError, match=message):
        model_class(config)


def test_the_mla_split_reads_the_host_metadata_not_the_devices():
    """A prefill step's split (a prompt chunk over its prefix decompressed, a short one over a long prefix absorbed)
    takes its lengths and the decompressed context's slots from the metadata the host built: read back from the
    device, they would wait for all the work queued before them. The device tensors here are on the meta device,
    which has no values to read."""
    new, ctx = np.array([200, 2]), np.array([300, 502])
    tables = torch.arange(64, dtype=torch.int32).view(2, 32)
    host = AttentionMetadata(slot_mapping=torch.arange(202), block_tables=tables,
                             context_lens=torch.tensor(ctx, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, *np.cumsum(new)], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, *np.cumsum(ctx)], dtype=torch.int32), max_seqlen_q=200,
                             max_seqlen_k=502, block_size=16, has_cached_prefix=True)
    prepared = []
    split = mla.mla_split(host.to(torch.device("meta")), mla.MLADims(16, 512, 128, 64, 128), 2,
                          type("Backend", (), {"prepare": lambda self, meta: prepared.append(meta)})())
    assert [m.num_seqs for m in prepared] == [1, 1]  # decompressed, then absorbed
    assert split.decompressed.context_lens.device.type == "meta" and split.context_slots.shape == (300,)


@pytest.mark.parametrize("as_on_cuda", [False, True], ids=["cpu", "host-metadata-as-on-cuda"])
def test_mla_steps_mixing_decodes_and_prompts_equal_a_plain_run(as_on_cuda, model_dir, monkeypatch):
    """A prompt admitted beside a decoding sequence (two sequences at most) splits its step: on CUDA the metadata
    comes with its host copy (InputBatch.to_device), made so here too, which the PyTorch backend reads; each subset
    of the split must carry its own, not the whole step's."""
    if as_on_cuda:
        to_device = InputBatch.to_device

        def with_host(self, input_ids, positions, meta):
            ids, pos, device_meta = to_device(self, input_ids, positions, meta)
            return ids, pos, dataclasses.replace(device_meta, host=meta)

        monkeypatch.setattr(InputBatch, "to_device", with_host)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 10, 8)]
    d = str(model_dir("deepseek-v3"))
    outputs = {}
    for max_num_seqs in (2, 8):
        with LLM(d, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=max_num_seqs) as llm:
            outputs[max_num_seqs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[2] == outputs[8]
