"""LoRA adapters (vLLM's enable_lora / LoRARequest): random PEFT adapters written in PEFT's file format, checked
against transformers running the base checkpoint with each adapter merged into its weights (W + scale * B @ A);
mixed batches, slot eviction, prefix caching, chunked prefill, preemption, tensor parallelism, bad adapters."""
import gc
import json
import math
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cuda_fakes import capture_recorded_graphs, count_replays
from models import ODD_KIND, cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, BeamSearchParams, LoRARequest, SamplingParams
from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.sampling_state import HostStaging
from nanoinfer.lora.layers import LoRALayer
from nanoinfer.lora.model import LoRAModel
from test_beam_search import assert_same_beams, beams_of
from test_cuda_audit import audited_capture

MAX_TOKENS = 12
LOGIT_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(4, 5, 440, 3, 40, seed=41)
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


@dataclass
class Adapter:
    request: LoRARequest
    merged: Path  # the base model with the adapter merged into its weights: transformers' reference


def write_adapter(base: Path, dst: Path, lora_id: int, r: int, alpha: float, modules: tuple[str, ...], seed: int,
                  use_rslora: bool = False, layers: tuple[int, ...] | None = None, **config) -> Adapter:
    """A PEFT LoRA adapter on `modules` (of `layers`, default all) with random, non-zero A and B, saved as PEFT saves
    one (adapter_config.json, adapter_model.safetensors with `base_model.model.<module>.lora_A/B.weight`), and the
    base checkpoint with it merged."""
    weights = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    scale = alpha / (math.sqrt(r) if use_rslora else r)
    tensors, merged = {}, dict(weights)
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        parts = module.split(".")
        if parts[-1] not in modules or (layers is not None and int(parts[2]) not in layers):
            continue
        a, b = 0.2 * torch.randn(r, w.shape[1], generator=g), 0.1 * torch.randn(w.shape[0], r, generator=g)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = w + scale * b @ a
    adapter = dst / "adapter"
    adapter.mkdir(parents=True)
    save_file(tensors, adapter / "adapter_model.safetensors")
    settings = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=str(base), r=r, lora_alpha=alpha,
                    lora_dropout=0.0, target_modules=list(modules), use_rslora=use_rslora, use_dora=False, bias="none",
                    fan_in_fan_out=False, modules_to_save=None, rank_pattern={}, alpha_pattern={},
                    layers_to_transform=list(layers) if layers else None)
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, **config}, indent=2))
    shutil.copytree(base, dst / "merged")
    save_file(merged, dst / "merged" / "model.safetensors", metadata={"format": "pt"})
    return Adapter(LoRARequest(f"adapter{lora_id}", lora_id, str(adapter)), dst / "merged")


# The families whose checkpoints (and so their PEFT adapters) name these projections otherwise: Phi-3 fuses q/k/v
# and gate/up, GPT-NeoX fuses q/k/v per head; the LayerNorm families' MLPs have no gate (gate and up mean fc1).
MODULE_NAMES = {
    "phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"},
    "gpt-neox": {"q_proj": "query_key_value", "k_proj": "query_key_value", "v_proj": "query_key_value",
                 "o_proj": "dense", "gate_proj": "dense_h_to_4h", "up_proj": "dense_h_to_4h",
                 "down_proj": "dense_4h_to_h"},
    "starcoder2": {"gate_proj": "c_fc", "up_proj": "c_fc", "down_proj": "c_proj"},
}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """adapters(kind) -> three adapters of distinct ranks, alphas and targets (the second rsLoRA, its targets a
    regex; the third on two layers only)."""
    made: dict[str, list[Adapter]] = {}

    def get(kind: str) -> list[Adapter]:
        if kind not in made:
            base, root = model_dir(kind), tmp_path_factory.mktemp(f"lora_{kind}")
            fused = MODULE_NAMES.get(kind, {})

            def modules(*names: str) -> tuple[str, ...]:
                return tuple(dict.fromkeys(fused.get(m, m) for m in names))

            made[kind] = [
                write_adapter(base, root / "1", 1, r=8, alpha=16, modules=modules(*ATTENTION, *MLP), seed=1),
                write_adapter(base, root / "2", 2, r=4, alpha=6, modules=modules("q_proj", "v_proj", "down_proj"),
                              seed=2, use_rslora=True, target_modules=r".*\.(q_proj|v_proj|down_proj)"),
                write_adapter(base, root / "3", 3, r=2, alpha=3, modules=modules("o_proj", *MLP), seed=3,
                              layers=(0, 2)),
            ]
        return made[kind]
    return get


def lora_llm(base: Path, **kwargs) -> LLM:
    defaults = dict(device="cpu", dtype="float32", max_model_len=128, enable_lora=True, max_loras=3, max_lora_rank=8)
    return LLM(str(base), **{**defaults, **kwargs})


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def reference(adapter: Adapter | None, base: Path, prompts=PROMPTS) -> list[dict]:
    return cached_hf_greedy(base if adapter is None else adapter.merged, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3", "gpt-neox", "starcoder2"])
def test_adapters_match_transformers_on_merged_weights(kind, model_dir, adapters, captured_logits,
                                                       report_logit_diff):
    base = model_dir(kind)
    llm = lora_llm(base)
    plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for adapter in adapters(kind):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter.request)
        assert tokens(outputs) != plain  # the adapter changes what the model says
        worst = check_against_hf(outputs, reference(adapter, base), captured_logits)
        report_logit_diff(f"{kind}, LoRA {adapter.request.lora_name}", worst)
        assert worst < LOGIT_ATOL, f"{kind}, {adapter.request.lora_name}: max |logit diff| {worst:.2e}"


def test_one_batch_mixing_adapters_gives_each_request_its_own_tokens(llama_dir, adapters):
    """One step runs tokens of adapters 1, 2, 3 and none: each request gets what it gets alone; the step API, chat
    and generate_iter take the adapter too."""
    a1, a2, a3 = (a.request for a in adapters("llama"))
    llm = lora_llm(llama_dir)
    prompts = PROMPTS + PROMPTS[:2]
    loras = [a1, a2, None, a3, a2, a1]
    mixed = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0] for p, lora in zip(prompts, loras)]
    assert mixed == alone
    assert mixed[0] != mixed[4] and mixed[1] != mixed[5]  # PROMPTS[0] and [1] under adapters 1 and 2
    assert mixed[0] == reference(adapters("llama")[0], llama_dir)[0]["token_ids"]
    assert mixed[2] == reference(None, llama_dir)[2]["token_ids"]
    streamed = list(llm.generate_iter(PROMPTS[:1], GREEDY, lora_request=a1))
    assert streamed[-1].outputs[0].token_ids == mixed[0]
    llm.llm_engine.add_request("step", PROMPTS[1], GREEDY, lora_request=a2)
    done = []
    while llm.llm_engine.has_unfinished_requests():
        done += [o for o in llm.llm_engine.step() if o.finished]
    assert tokens(done) == [mixed[1]]
    conversation = [{"role": "user", "content": "Hello, how are you?"}]
    ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    chat = tokens(llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=a3))
    assert chat == tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False, lora_request=a3))
    assert chat != tokens(llm.chat(conversation, GREEDY, use_tqdm=False))


def test_more_adapters_than_slots(llama_dir, adapters):
    """Two slots, three adapters: over time the least recently used idle adapter is evicted and reloaded when
    needed again; a batch wanting all three at once runs at most two at a time (the third waits, as in vLLM)."""
    a1, a2, a3 = (a.request for a in adapters("llama"))
    expected = {a.request.lora_int_id: reference(a, llama_dir) for a in adapters("llama")}
    llm = lora_llm(llama_dir, max_loras=2)
    for lora in (a1, a2, a3, a1, a3, a2):
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=lora)
        assert tokens(outputs) == [r["token_ids"] for r in expected[lora.lora_int_id][:2]]
    assert sorted(llm.llm_engine.model_runner.lora.resident) == [2, 3]
    runner, seen = llm.llm_engine.model_runner, []
    run = runner.launch

    def recording_run(batch):
        seen.append({s.lora_int_id for s in batch.seqs} - {0})
        return run(batch)

    runner.launch = recording_run
    loras = [a1, a2, a3, None]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert max(map(len, seen)) == 2 and set().union(*seen) == {1, 2, 3}
    for i, (out, lora) in enumerate(zip(outputs, loras)):
        ref = reference(None, llama_dir) if lora is None else expected[lora.lora_int_id]
        assert out.outputs[0].token_ids == ref[i]["token_ids"]


def test_prefix_cache_is_not_shared_between_adapters(llama_dir, adapters):
    """The adapter is part of every block's hash: the same prompt under another adapter (or none) computes its own
    K/V, also when both are admitted in the same step; under the same adapter it hits the cache."""
    a1, a2, a3 = adapters("llama")
    prompt = random_prompts(1, 5, 440, 40, 40, seed=43)[0]  # two full blocks of 16 can be cached
    llm = lora_llm(llama_dir)

    def run(*loras):
        outputs = llm.generate([prompt] * len(loras), GREEDY, use_tqdm=False,
                               lora_request=[None if a is None else a.request for a in loras])
        for out, a in zip(outputs, loras):
            assert out.outputs[0].token_ids == reference(a, llama_dir, [prompt])[0]["token_ids"]
        return [o.num_cached_tokens for o in outputs]

    assert run(a1, a2, None) == [0, 0, 0]  # admitted in one step: each computes its own blocks
    assert run(a2, a1, None, a2) == [32, 32, 32, 32]
    assert run(a3) == [0]
    assert run(a3) == [32]


def test_chunked_prefill_and_preemption_keep_the_adapters(llama_dir, adapters):
    """A 20-token budget splits prompts into chunks; 16 blocks of 8 tokens force preemption and recompute, which runs
    each sequence's adapter again."""
    a1, a2, a3 = (a.request for a in adapters("llama"))
    expected = {a.request.lora_int_id: reference(a, llama_dir) for a in adapters("llama")}
    expected[0] = reference(None, llama_dir)
    llm = lora_llm(llama_dir, num_kvcache_blocks=16, kvcache_block_size=8, max_num_batched_tokens=20)
    loras = [a1, a2, None, a3]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for i, (out, lora) in enumerate(zip(outputs, loras)):
        assert out.outputs[0].token_ids == expected[0 if lora is None else lora.lora_int_id][i]["token_ids"]


BEAMS = BeamSearchParams(3, 6, ignore_eos=True)


def test_beam_search_with_adapters_matches_merged_weights(llama_dir, adapters):
    """beam_search with one adapter for every prompt, or one (or None) per prompt (the same prompt under two adapters
    and none in one call), gives the beams and cumulative logprobs of beam search on the model with the adapter
    merged into its weights."""
    a1, a2, _ = adapters("llama")
    prompts = PROMPTS[:2]

    def merged(adapter: Adapter | None) -> list:
        base = llama_dir if adapter is None else adapter.merged
        with LLM(str(base), device="cpu", dtype="float32", max_model_len=128) as ref:
            return beams_of(ref.beam_search(prompts, BEAMS))

    plain, one, two = merged(None), merged(a1), merged(a2)
    assert [b[0][0] for b in one] != [b[0][0] for b in plain]  # the adapter changes the best beams
    llm = lora_llm(llama_dir)
    assert_same_beams(beams_of(llm.beam_search(prompts, BEAMS, lora_request=a1.request)), one)
    mixed = llm.beam_search([prompts[0], prompts[0], prompts[0], prompts[1]], BEAMS,
                            lora_request=[a2.request, None, a1.request, a2.request], concurrency_limit=3)
    assert_same_beams(beams_of(mixed), [two[0], plain[0], one[0], two[1]])


def test_beam_search_refuses_a_bad_lora_request_before_the_first_step(llama_dir, adapters, monkeypatch):
    a1 = adapters("llama")[0].request
    llm = lora_llm(llama_dir)
    monkeypatch.setattr(ModelRunner, "launch", lambda self, batch: pytest.fail("a step ran"))
    bad_calls = [
        ("adapter1", TypeError, "lora_request must be a LoRARequest or a list of them, got str"),
        ([a1], ValueError, "got 1 lora requests for 2 prompts"),
        ([a1, "adapter1"], TypeError, "lora_request must be a LoRARequest, got str"),  # the second chunk's
        ([a1, LoRARequest("x", 7, "/nonexistent")], ValueError, "lora_path '/nonexistent' of LoRA adapter 'x' is not"),
    ]
    for lora_request, error, message in bad_calls:
        with pytest.raises(error, match=message):
            llm.beam_search(PROMPTS[:2], BEAMS, lora_request=lora_request, concurrency_limit=1)
    with pytest.raises(ValueError, match="lora_request=.*given, but LoRA is off: create the LLM with enable_lora=True"):
        LLM(str(llama_dir), device="cpu", max_model_len=64).beam_search(PROMPTS[:1], BEAMS, lora_request=a1)


@pytest.mark.slow
# ODD_KIND: 1 KV head on both ranks; phi3: fused qkv and gate_up; gpt-neox: qkv fused per head, an ungated MLP
@pytest.mark.parametrize("kind", ["llama", ODD_KIND, "phi3", "gpt-neox"])
def test_tensor_parallel_2_equals_1(kind, model_dir, adapters):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A (summed by the all-reduce);
    two slots for three adapters, so the worker evicts and loads too."""
    base = model_dir(kind)
    loras = [a.request for a in adapters(kind)] + [None]
    results = []
    for tp in (1, 2):
        with lora_llm(base, max_loras=2, tensor_parallel_size=tp) as llm:
            results.append(tokens(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=loras * 2)))
    assert results[0] == results[1]
    for i, adapter in enumerate(adapters(kind)):
        assert results[1][i] == reference(adapter, base)[i]["token_ids"]


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_slots_are_made_where_the_weights_live(kind, model_dir):
    """On the weights' device (meta here, as CUDA would be) and in their dtype, one max-rank block per packed
    sub-projection; mixture-of-experts layers get none."""
    config = Config(model_dir(kind), device="cpu", dtype="bfloat16")
    model = ModelRunner._load_model(config, torch.device("meta"))
    lora = LoRAModel(model, max_loras=3, max_lora_rank=8, upload=HostStaging(torch.device("meta")))
    blocks = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}
    assert {name.rpartition(".")[2] for name in lora.layers} == set(blocks)
    dense_mlps = 3 if kind == "llama" else 1  # qwen3-moe: layer 1 only (mlp_only_layers)
    assert sum(name.endswith("down_proj") for name in lora.layers) == dense_mlps
    for name, layer in lora.layers.items():
        weight = model.get_submodule(name).weight
        assert layer.lora_a.shape == (3, 8 * blocks[name.rpartition(".")[2]], weight.shape[1])
        assert layer.lora_b.shape == (weight.shape[0], 3, 8 * blocks[name.rpartition(".")[2]])
        assert {t.device.type for t in (layer.lora_a, layer.lora_b)} == {"meta"}
        assert {t.dtype for t in (layer.lora_a, layer.lora_b)} == {torch.bfloat16}


def test_close_frees_the_slots_without_the_garbage_collector(llama_dir, adapters):
    gc.collect()
    gc.disable()
    try:
        llm = lora_llm(llama_dir)
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters("llama")[0].request)
        slots = [weakref.ref(t) for layer in llm.llm_engine.model_runner.lora.layers.values()
                 for t in (layer.lora_a, layer.lora_b)]
        llm.close()
        assert [r for r in slots if r() is not None] == []
    finally:
        gc.enable()


def test_warm_up_runs_every_layer_through_a_slot(llama_dir, adapters, monkeypatch):
    """On CUDA the warm-up that sizes the KV cache must see the LoRA products' temporaries: it runs every token
    through slot 0 (still zeros) in every layer; an adapter loaded there afterwards targets only its own layers."""
    llm = lora_llm(llama_dir, max_loras=1, max_num_batched_tokens=64, max_num_seqs=4)
    runner, seen = llm.llm_engine.model_runner, []
    add_to = LoRALayer.add_to

    def recording_add_to(self, y, x):
        seen.append((id(self), len(x), [(slot, rows) for slot, rows in self.step.groups if self.active[slot]]))
        add_to(self, y, x)

    monkeypatch.setattr(LoRALayer, "add_to", recording_add_to)
    runner._warm_up()
    assert {layer for layer, _, _ in seen} == {id(layer) for layer in runner.lora.layers.values()}
    assert all(n == 64 and groups == [(0, slice(0, 64))] for _, n, groups in seen)
    a3 = adapters("llama")[2]  # on o_proj and the MLP of layers 0 and 2 only
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=a3.request)
    assert tokens(outputs) == [r["token_ids"] for r in reference(a3, llama_dir)]
    assert sum(layer.active[0] for layer in runner.lora.layers.values()) == 2 * 3


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_decode_through_graph_buffers_matches_transformers_on_merged_weights(kind, model_dir, adapters, monkeypatch,
                                                                             captured_logits, report_logit_diff):
    """Decode steps replayed from the graph runner's static buffers and padding (RecordedGraph: a graph's semantics on
    the CPU), each token through its own slot read from a static buffer (LoRALayer.add_every_slot): three adapters
    and the base model in one batch, 4 sequences at the captured size 4, then 3 at it (one padding row), each equal
    to transformers on merged weights; the adapters are loaded into their slots after the capture, and one slot's
    layers that its adapter leaves alone stay out of its tokens' products, whatever an earlier adapter left there."""
    replays = count_replays(monkeypatch)
    base = model_dir(kind)
    loras = [a.request for a in adapters(kind)] + [None]
    with lora_llm(base, max_num_seqs=4) as llm:
        runner = llm.llm_engine.model_runner
        if not runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        assert runner.model_capturable()
        capture_recorded_graphs(runner)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
        outputs += llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False, lora_request=loras[1:])
        assert replays == [runner.graph_runner.graphs[4]] * 2 * (MAX_TOKENS - 1)
    worst = max(check_against_hf([out], reference(adapter, base, [prompt]), captured_logits) for out, adapter, prompt
                in zip(outputs, adapters(kind) + [None] + adapters(kind)[1:] + [None], PROMPTS + PROMPTS[1:]))
    # One slot: the third adapter (on some layers only) replaces the first (on all) there, whose A and B stay in
    # the layers the third leaves alone, inactive.
    a1, _, a3 = adapters(kind)
    captured_logits.clear()  # a new engine numbers its sequences from 0 again
    with lora_llm(base, max_num_seqs=4, max_loras=1) as llm:
        capture_recorded_graphs(llm.llm_engine.model_runner)
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a1.request)
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=a3.request)
    worst = max(worst, check_against_hf(outputs, reference(a3, base, PROMPTS[:2]), captured_logits))
    report_logit_diff(f"{kind}, LoRA decode through graph buffers", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_decode_forward_with_adapters_never_syncs_with_the_host(llama_dir, adapters):
    """What a decode graph captures with LoRA (an adapter loaded, active in some layers only) reads no value back to
    the host and makes no value-dependent shape, which would fail the capture on CUDA (see test_cuda_audit)."""
    with lora_llm(llama_dir, max_num_seqs=4) as llm:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters("llama")[2].request)
        graphs, found = audited_capture(llm.llm_engine.model_runner)
    assert graphs.sizes == [1, 2, 4] and found == []


@pytest.mark.cuda
def test_cuda_matches_transformers_on_merged_weights(llama_dir, adapters):
    """On a GPU in fp32, decoding from CUDA graphs (each token's slot from a static buffer): greedy tokens equal
    transformers' up to near-ties."""
    loras = [a.request for a in adapters("llama")] + [None]
    with lora_llm(llama_dir, device="cuda", num_kvcache_blocks=64) as llm:
        assert llm.llm_engine.model_runner.graph_runner is not None
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    for i, (out, adapter) in enumerate(zip(outputs, adapters("llama") + [None])):
        check_against_hf([out], reference(adapter, llama_dir)[i:i + 1])


def edited_adapter(adapter: Adapter, dst: Path, config: dict | None = None, tensors: dict | None = None) -> LoRARequest:
    """A copy of the adapter with config keys replaced, tensors replaced or added (None: removed)."""
    src = Path(adapter.request.path)
    shutil.copytree(src, dst)
    settings = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**settings, **(config or {})}))
    weights = {**load_file(src / "adapter_model.safetensors"), **(tensors or {})}
    save_file({k: v for k, v in weights.items() if v is not None}, dst / "adapter_model.safetensors")
    return LoRARequest("edited", 99, str(dst))


@pytest.fixture(scope="module")
def one_slot_llm(llama_dir) -> LLM:
    """Shared by the tests of bad input: each must leave it usable."""
    return lora_llm(llama_dir, max_loras=1)


A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("config, tensors, message", [
    (dict(bias="all"), None, "bias='all' in .*adapter_config.json"),
    (dict(use_dora=True), None, "use_dora=True in .*adapter_config.json: DoRA"),
    (dict(modules_to_save=["lm_head"]), None, r"modules_to_save=\['lm_head'\] in .*adapter_config.json"),
    (dict(target_modules=["q_proj", "embed_tokens"]), None, "target_modules=.*embed_tokens.* in .*adapter_config"),
    (dict(target_modules="lm_|lm_head"), None, "target_modules='lm_|lm_head' in .*adapter_config.json"),
    (dict(r=16), None, "r=16 in .*adapter_config.json exceeds max_lora_rank=8"),
    (dict(peft_type="IA3"), None, "peft_type='IA3' in .*adapter_config.json"),
    (dict(rank_pattern={"q_proj": 4}), None, "rank_pattern=.* in .*adapter_config.json"),
    (dict(lora_alpha="16"), None, "lora_alpha='16' in .*adapter_config.json"),
    (None, {B_KEY: None}, f"adapter_model.safetensors holds '{A_KEY}' without its lora_B"),
    (None, {A_KEY: torch.ones(8, 63)}, f"'{A_KEY}'.* has 63 input features, the layer 64"),
    (None, {B_KEY: torch.ones(8, 8)}, "cannot load LoRA tensors .*q_proj.* in .*adapter_model.safetensors.* rows"),
    (None, {A_KEY: torch.ones(4, 64)}, f"'{A_KEY}' in .*adapter_model.safetensors has shape \\(4, 64\\).* r=8"),
    (None, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 512)},
     "'base_model.model.model.embed_tokens.lora_embedding_A' in .*adapter_model.safetensors is not"),
    (None, {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.ones(8, 64),
            "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight": torch.ones(128, 8)},
     "adapter_model.safetensors targets 'model.layers.0.self_attn.qkv_proj' twice"),
    (None, {"base_model.model.model.norm.lora_A.weight": torch.ones(8, 64),
            "base_model.model.model.norm.lora_B.weight": torch.ones(64, 8)},
     "'base_model.model.model.norm.lora_A.weight' in .*: LoRA on 'model.norm' is not supported by LlamaForCausalLM"),
])
def test_bad_adapters_are_refused_by_name_and_the_engine_stays_usable(one_slot_llm, llama_dir, adapters, tmp_path,
                                                                       config, tensors, message):
    a1, llm = adapters("llama")[0], one_slot_llm
    bad = edited_adapter(a1, tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=[bad])
    assert not llm.llm_engine.requests and not llm.llm_engine.scheduler.waiting
    outputs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a1.request)
    assert tokens(outputs) == [reference(a1, llama_dir)[0]["token_ids"]]


def test_bad_requests_and_settings(one_slot_llm, llama_dir, model_dir, adapters, tmp_path):
    a1, a2, _ = (a.request for a in adapters("llama"))
    with pytest.raises(ValueError, match="lora_request=.*given, but LoRA is off: create the LLM with enable_lora=True"):
        LLM(str(llama_dir), device="cpu", max_model_len=64).generate("x", GREEDY, lora_request=a1)
    llm = one_slot_llm
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'adapter1'"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, a2.lora_path))
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest, got str"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=["adapter1"])
    with pytest.raises(ValueError, match="got 1 lora requests for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[a1])
    with pytest.raises(ValueError, match="lora_path '/nonexistent' of LoRA adapter 'x' is not a directory"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 7, "/nonexistent"))
    with pytest.raises(ValueError, match=f"LoRA adapter directory '{tmp_path}' holds no adapter_config.json"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 8, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be >= 1, got 0"):
        LoRARequest("x", 0, "/a")
    for kwargs, error, message in [(dict(max_loras=0), ValueError, "max_loras must be >= 1, got 0"),
                                   (dict(max_lora_rank=2.5), TypeError, "max_lora_rank must be an int, got 2.5"),
                                   (dict(enable_lora="yes"), TypeError, "enable_lora must be a bool, got 'yes'")]:
        with pytest.raises(error, match=message):
            Config(str(llama_dir), device="cpu", **kwargs)
    # Mixture-of-experts experts are not dense layers with a LoRA path here.
    moe = model_dir("qwen3-moe")
    key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
    expert = tmp_path / "expert"
    expert.mkdir()
    save_file({key: torch.ones(2, 64), key.replace("lora_A", "lora_B"): torch.ones(32, 2)},
              expert / "adapter_model.safetensors")
    (expert / "adapter_config.json").write_text(json.dumps(dict(r=2, lora_alpha=2, target_modules=["gate_proj"])))
    with pytest.raises(ValueError, match=f"'{key}' in .*LoRA on 'model.layers.0.mlp.experts.0.gate_proj' is not"):
        lora_llm(moe).generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("e", 1, str(expert)))
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a1)) == [
        reference(adapters("llama")[0], llama_dir)[0]["token_ids"]]


def test_every_slot_path_keeps_an_overflowing_slot_out_of_other_tokens():
    """The decode graphs' path (add_every_slot) computes every slot's products for every token: an fp16 one that
    overflows in a slot the token does not use (or in an evicted adapter's A, left in an inactive slot) must not
    reach it (masked by a product, inf * 0 made it NaN)."""
    layer = torch.nn.Linear(4, 3, bias=False).half()
    lora = LoRALayer(layer, [None], max_loras=2, max_rank=2, step=None)
    lora.lora_a[0].fill_(3e4)  # x A overflows fp16 for slot 0
    lora.lora_b[:, 0].fill_(1.0)
    lora.set_active(0, True)
    lora.lora_a[1].fill_(1e4)  # an evicted adapter's A, in a slot inactive here
    x, y = torch.full((3, 4), 2.0, dtype=torch.float16), torch.zeros(3, 3, dtype=torch.float16)
    lora.add_every_slot(y, x, torch.tensor([-1, 1, 0]))
    assert torch.equal(y[:2], torch.zeros(2, 3, dtype=torch.float16)) and y[2].isinf().all()
