"""Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, FlexOLMo, GLM-4.5, dots.llm1, ERNIE 4.5, Hunyuan, Llama 4,
PhiMoE, EXAONE-MoE, DBRX, DeepSeek): the fused expert layer against transformers' own MoE block, its tensor-parallel
shards, which layers are sparse, checkpoint layouts (per expert as on the Hub, Mixtral's names, transformers' stacked
experts) and mapping errors; PhiMoE's sparsemixer and DBRX's p-norm routing against transformers'; on whole models,
routing equal to transformers' and varied, chunked prefill + prefix cache + preemption, with TP=1 and 2 (DeepSeek's
too; its routers and the rest: test_deepseek.py). (Plain whole-model greedy/logits: test_correctness.py.)"""
import inspect
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

import nanoinfer.layers.fused_moe as fused_moe
from models import (DEEPSEEK_KINDS, NEWEST_MOE_KINDS, cached_hf_greedy, check_against_hf, load_hf_model, make_config,
                    random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.fused_moe import FusedMoE, SparseMoeBlock, select_experts
from nanoinfer.models.llama4 import Llama4MoE
from nanoinfer.models.mixtral import MixtralForCausalLM
from nanoinfer.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock
from nanoinfer.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from nanoinfer.utils.loader import iter_safetensors, load_weights


def hf_block(renormalize: bool, seed: int = 0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFBlock

    config = make_config("qwen3-moe")
    config.norm_topk_prob = renormalize
    torch.manual_seed(seed)
    block = HFBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return config, block


def expert_checkpoint(block) -> dict[str, torch.Tensor]:
    """The block's weights as a checkpoint stores them: one gate/up/down matrix per expert."""
    inter = block.experts.intermediate_dim
    tensors = {"mlp.gate.weight": block.gate.weight.detach()}
    for e in range(block.experts.num_experts):
        gate_up, down = block.experts.gate_up_proj[e].detach(), block.experts.down_proj[e].detach()
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[:inter]
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[inter:]
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down
    return tensors


class Wrapper(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = Qwen3MoeSparseMoeBlock(config)


@pytest.mark.parametrize("renormalize", [True, False])
@torch.inference_mode()
def test_moe_block_matches_transformers(renormalize):
    config, ref = hf_block(renormalize)
    ours = Wrapper(config)
    load_weights(ours, expert_checkpoint(ref).items())
    x = torch.randn(37, config.hidden_size)
    expected = ref(x.unsqueeze(0))[0]
    got = ours.mlp(x)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.abs().mean().item() > 0.1  # not a trivially small output


@torch.inference_mode()
@pytest.mark.parametrize("dtype, hidden, inter", [(torch.bfloat16, 64, 36), (torch.float32, 120, 37),
                                                  (torch.bfloat16, 100, 32)])
def test_experts_of_widths_off_16_bytes_match_a_loop_over_tokens(dtype, hidden, inter):
    """torch._grouped_mm needs its operands' row strides in multiples of 16 bytes; expert widths that are not (an
    intermediate size of 36 in bf16) are padded with zero columns, which add nothing."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    w13 = torch.randn(6, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(6, hidden, inter, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(5, 6, generator=g).to(dtype), 2, True)
    x32, w13_32, w2_32 = x.float(), w13.float(), w2.float()
    want = sum(weights[:, j, None].float() * torch.stack([  # in fp32: bf16's own rounding is the tolerance
        F.linear(F.silu(F.linear(x32[t], w13_32[e, :inter])) * F.linear(x32[t], w13_32[e, inter:]), w2_32[e])
        for t, e in enumerate(ids[:, j].tolist())]) for j in range(2))
    got = fused_moe.fused_experts(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(got, want, rtol=0, atol=(2e-2 if dtype == torch.bfloat16 else 1e-5) * want.abs().max())


def test_moe_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks' halves of every expert's intermediate dimension add up (the all-reduce) to the full output."""
    config, ref = hf_block(True, seed=1)
    x = torch.randn(11, config.hidden_size)
    full = FusedMoE(8, 2, config.hidden_size, 32, renormalize=True)
    load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": full})}),
                 [(k, v) for k, v in expert_checkpoint(ref).items() if ".experts." in k])
    logits = x @ ref.gate.weight.T
    parts = []
    for rank in range(2):
        monkeypatch.setattr(fused_moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(fused_moe, "tp_size", lambda: 2)
        shard = FusedMoE(8, 2, config.hidden_size, 32, renormalize=True, reduce_results=False)
        assert shard.w13_weight.shape == (8, 32, config.hidden_size) and shard.w2_weight.shape == (8, config.hidden_size, 16)
        for name, tensor in expert_checkpoint(ref).items():
            target = fused_moe.expert_weight_target(name)
            if target is not None:
                shard.weight_loader(getattr(shard, target[0].rsplit(".", 1)[1]), tensor, target[1])
        parts.append(shard(x, logits))
    whole = full(x, logits)
    assert (parts[0] + parts[1] - whole).abs().max().item() < 1e-5
    assert (parts[0] - whole).abs().max().item() > 1e-2  # each rank alone is only part of it


@torch.inference_mode()
def test_stacked_experts_load_as_the_per_expert_ones(monkeypatch):
    """transformers' own layout, all experts in `experts.gate_up_proj` / `experts.down_proj`, gives each
    tensor-parallel rank the same slices as the per-expert tensors of the Hub's checkpoints."""
    config, ref = hf_block(True, seed=2)
    stacked = {"mlp.experts.gate_up_proj": ref.experts.gate_up_proj.detach(),
               "mlp.experts.down_proj": ref.experts.down_proj.detach()}
    per_expert = {k: v for k, v in expert_checkpoint(ref).items() if ".experts." in k}
    monkeypatch.setattr(fused_moe, "tp_size", lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(fused_moe, "tp_rank", lambda: rank)
        a, b = (FusedMoE(8, 2, config.hidden_size, 32, renormalize=True) for _ in range(2))
        load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": a})}), per_expert.items())
        load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": b})}), stacked.items())
        assert torch.equal(a.w13_weight, b.w13_weight) and torch.equal(a.w2_weight, b.w2_weight)
    seven = {"mlp.experts.gate_up_proj": stacked["mlp.experts.gate_up_proj"][:7]}.items()
    with pytest.raises(ValueError, match=r"'mlp.experts.gate_up_proj'.*shape mismatch.*\(8, 64, 64\)"):
        load_weights(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": a})}), seven)


@pytest.mark.parametrize("kind, cls, block", [("qwen3-moe", Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock),
                                               ("qwen2-moe", Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock)])
def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(kind, cls, block):
    config = make_config(kind)
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 6, 2, [3]
    config.layer_types = ["full_attention"] * 6
    model = cls(config)
    sparse = [isinstance(layer.mlp, block) for layer in model.model.layers]
    assert sparse == [False, True, False, False, False, True]


def test_missing_or_extra_expert_is_reported(model_dir, tmp_path):
    d = model_dir("qwen3-moe")
    weights = load_file(d / "model.safetensors")
    for name, change in [("model.layers.2.mlp.experts.5.up_proj.weight", "drop"),
                         ("model.layers.0.mlp.experts.8.gate_proj.weight", "add")]:
        broken = tmp_path / change
        broken.mkdir()
        for f in d.iterdir():
            if f.suffix != ".safetensors":
                (broken / f.name).write_bytes(f.read_bytes())
        tensors = dict(weights)
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = weights["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()
        save_file(tensors, broken / "model.safetensors")
        with pytest.raises(ValueError, match="missing weights.*w13_weight" if change == "drop" else "expert 8"):
            LLM(str(broken), device="cpu", dtype="float32", max_model_len=64)


@pytest.mark.parametrize("change, message", [("drop", "missing weights.*w13_weight"), ("truncate", "shape mismatch")])
def test_dbrx_missing_or_misshaped_experts_are_reported(change, message, model_dir, tmp_path):
    """DBRX's w1 and v1 each fill half of every expert's w13: one without the other is missing weights."""
    d = model_dir("dbrx")
    tensors = load_file(d / "model.safetensors")
    broken = tmp_path / change
    broken.mkdir()
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    name = "transformer.blocks.1.ffn.experts.mlp.v1"
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        LLM(str(broken), device="cpu", dtype="float32", max_model_len=64)


class Llama4Wrapper(torch.nn.Module):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # the shared expert's

    def __init__(self, config):
        super().__init__()
        self.mlp = Llama4MoE(config)


@torch.inference_mode()
def test_llama4_moe_matches_transformers_where_its_stacked_experts_look_square():
    """transformers' Llama4TextMoe (the top k router logits' sigmoids scaling the experts' input, a shared expert)
    with hidden = 2 x intermediate: its [experts, hidden, 2 * inter] gate_up_proj then has our layout's shape too,
    and is still read as transposed."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = make_config("llama4")
    config.intermediate_size = config.hidden_size // 2
    torch.manual_seed(0)
    ref = Llama4TextMoe(config).eval()
    for p in ref.parameters():
        p.normal_(0, 0.2)
    ours = Llama4Wrapper(config)
    load_weights(ours, [(f"mlp.{name}", t) for name, t in ref.state_dict().items()])
    x = torch.randn(37, config.hidden_size)
    torch.testing.assert_close(ours.mlp(x), ref(x)[0], rtol=1e-5, atol=1e-5)


# ---- Mixtral and Qwen2-MoE, whole models against transformers ----

NEW_KINDS = ("mixtral", "qwen2-moe")
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(4, 5, 440, 5, 60, seed=41) + [[17]]
LOGIT_ATOL = 1e-4


def hf_routing(model_dir, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sparse layer of transformers' model over `tokens`: (router logits, chosen experts [tokens, k])."""
    model, found = load_hf_model(model_dir), []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: found.append((out[0], out[2])))
             for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.inference_mode():
            model(torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return found


@pytest.mark.parametrize("kind", NEW_KINDS + ("olmoe", "flexolmo"))
def test_routing_is_transformers_own_and_varied(kind, model_dir):
    """Our routers pick the same experts as transformers' for every token of prompts and continuations; the
    choice varies (every expert is used in every sparse layer, most pairs occur) and the k-th expert leads the next
    by >= 1e-5 in probability, so the logit comparisons elsewhere do not hang on rounding."""
    d = model_dir(kind)
    refs = cached_hf_greedy(d, PROMPTS, MAX_TOKENS)
    sequences = [p + r["token_ids"] for p, r in zip(PROMPTS, refs)]
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
        blocks = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, SparseMoeBlock)]
        ours: list[torch.Tensor] = []
        hooks = [b.gate.register_forward_hook(lambda m, i, out: ours.append(out.clone())) for b in blocks]
        for tokens in sequences:  # one prompt per step: each hook sees that sequence's tokens in order
            llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        for h in hooks:
            h.remove()
    assert len(blocks) == (2 if kind == "qwen2-moe" else 3)  # qwen2-moe: layer 1 is dense (mlp_only_layers)
    k = blocks[0].experts.top_k
    chosen: list[list[torch.Tensor]] = [[] for _ in blocks]
    for n, tokens in enumerate(sequences):
        for layer, (hf_logits, hf_ids) in enumerate(hf_routing(d, tokens)):
            logits = ours[n * len(blocks) + layer]
            ids = select_experts(logits, k, blocks[layer].experts.renormalize)[1]
            assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values), f"sequence {n}, sparse layer {layer}"
            top = torch.softmax(hf_logits.float(), -1).topk(k + 1, -1).values
            assert (top[:, k - 1] - top[:, k]).min().item() >= 1e-5, f"near-tie: sequence {n}, layer {layer}"
            chosen[layer].append(ids)
    for ids in chosen:
        ids = torch.cat(ids).sort(-1).values
        assert ids.unique().numel() == 8 and ids.unique(dim=0).shape[0] >= 20  # of the 28 pairs of 8 experts


@pytest.mark.parametrize("jitter_eps", [0.01, 0.1, 0.2])
def test_sparsemixer_is_transformers_own(jitter_eps):
    """PhiMoE's routing at inference: the same two experts and weights, bit for bit, as transformers' sparsemixer;
    the weights mix near experts in (0, 1) for some tokens, not for others."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = fused_moe.select_experts_sparsemixer(logits, jitter_eps)
    hf_weights, hf_ids = sparsemixer(logits, jitter_eps=jitter_eps, training=False)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert (weights < 1).any() and (weights == 1).any()


@pytest.mark.parametrize("p", [1.0, 2.0, None])
def test_dbrx_routing_is_transformers_own(p):
    """DBRX's top k, divided by their p-norm (moe_normalize_expert_weights; None: not at all), bit for bit as
    transformers' DbrxFFN routes them."""
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    config = make_config("dbrx")
    config.ffn_config.moe_normalize_expert_weights = p
    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    hf_weights, hf_ids = DbrxFFN(config).route_tokens_to_experts(logits)
    weights, ids = fused_moe.select_experts_pnorm(logits, config.ffn_config.moe_top_k, p)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_mixtral_hub_layout_loads(model_dir):
    """transformers saves Mixtral as the Hub's checkpoints are: `block_sparse_moe`, experts' `w1`/`w3`/`w2`
    (gate/up/down), which land in our `mlp` router and stacked expert weights."""
    d = model_dir("mixtral")
    weights = load_file(d / "model.safetensors")
    assert not any(".mlp." in name for name in weights)
    model = MixtralForCausalLM(AutoConfig.from_pretrained(d))
    load_weights(model, iter_safetensors(d))
    moe, prefix = model.model.layers[2].mlp, "model.layers.2.block_sparse_moe."
    assert torch.equal(moe.gate.weight, weights[prefix + "gate.weight"])
    for e in range(8):
        w1, w3, w2 = (weights[f"{prefix}experts.{e}.w{i}.weight"] for i in (1, 3, 2))
        assert torch.equal(moe.experts.w13_weight[e], torch.cat([w1, w3]))
        assert torch.equal(moe.experts.w2_weight[e], w2)


# With two ranks too where the family brings weights of its own to shard (OLMoE's, GLM-4.5's and dots.llm1's layers
# are OLMo 2's, Qwen3's and DeepSeek-V3's, tested sharded here and in test_olmo.py / test_tensor_parallel.py).
# Solar Open's and Youtu's layers are GLM-4.5's and DeepSeek-V3's (MLA) with Llama's MLP, sharded elsewhere.
TP2_KINDS = (NEW_KINDS + ("granitemoe-shared", "ernie4.5-moe", "hunyuan-moe", "llama4", "gemma4-moe", "phimoe", "dbrx")
             + DEEPSEEK_KINDS + ("minimax-m2", "cohere2-moe", "axk1") + NEWEST_MOE_KINDS)
CHUNKED_KINDS = TP2_KINDS + ("olmoe", "glm4-moe", "dots1", "flexolmo", "exaone-moe", "granitemoe-swa", "solar-open",
                             "cohere2-moe-sigmoid", "youtu")


@pytest.mark.parametrize("kind, tp", [(kind, 1) for kind in CHUNKED_KINDS]
                         + [pytest.param(kind, 2, marks=pytest.mark.slow) for kind in TP2_KINDS])
def test_chunked_prefill_prefix_cache_and_preemption_match_hf(kind, tp, model_dir, captured_logits,
                                                              report_logit_diff):
    """Shared 24-token prefixes, prefilled in 7-token chunks, a cache too small for every sequence (preemption),
    then the same prompts again from the prefix cache. With two ranks (a spawned worker), each holds half of every
    expert's and the shared expert's intermediate dimension, and a whole router and shared-expert gate."""
    d = model_dir(kind)
    shared = random_prompts(1, 5, 440, 24, 24, seed=42)[0]
    prompts = [shared + tail for tail in random_prompts(4, 5, 440, 1, 20, seed=43)]
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=7, kvcache_block_size=8,
             num_kvcache_blocks=12, tensor_parallel_size=tp) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(o.num_cached_tokens >= 24 for o in second)
    refs = cached_hf_greedy(d, prompts, MAX_TOKENS)
    worst = max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))
    report_logit_diff(f"{kind}, chunked + prefix cache + preemption, TP={tp}", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def aria_keeps_its_expert_names() -> bool:
    """transformers before 5.23 keeps Aria's `experts.fc1` / `fc2` in its own layout too."""
    from transformers.models.aria import modeling_aria
    return "gate_up_proj" not in inspect.getsource(modeling_aria.AriaExperts)


@pytest.mark.parametrize("kind", ("qwen3-moe",) + NEW_KINDS + ("ernie4.5-moe", "phimoe", "minimax-m2", "cohere2-moe",
                                                               "longcat-flash", "aria-text", "ergo"))
def test_transformers_stacked_expert_layout_matches_hf(kind, model_dir, tmp_path, captured_logits):
    """A checkpoint in transformers' own layout (`save_pretrained(save_original_format=False)`, which transformers
    loads back): stacked experts, Mixtral's MoE named `mlp` rather than `block_sparse_moe`, ERNIE's statics under
    the router (`mlp.gate.moe_statics`), LongCat-Flash's gate/up stack with rows for its zero experts too, Aria's
    [in, out] matrices under transformers' names, Ergo's [in, out] up stack (no gate) and untransposed router and
    shared expert."""
    if kind == "aria-text" and aria_keeps_its_expert_names():
        pytest.skip("this transformers keeps Aria's expert names (fc1, fc2) in its own layout")
    d = model_dir(kind)
    stacked = tmp_path / kind
    load_hf_model(d).save_pretrained(stacked, save_original_format=False)
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    with safe_open(stacked / "model.safetensors", "pt") as f:
        # Every test model's last layer is sparse (layer 2; LongCat-Flash's layer 1, of two).
        stack = "up_proj" if kind == "ergo" else "gate_up_proj"
        assert f"model.layers.{2 - (kind == 'longcat-flash')}.mlp.experts.{stack}" in f.keys()
    with LLM(str(stacked), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits) < LOGIT_ATOL


@pytest.mark.parametrize("changes, message", [
    (dict(expert_selection_fn="topk"), "expert_selection_fn='topk'"),
    (dict(shared_expert_combination_strategy="max"), "shared_expert_combination_strategy='max'"),
])
def test_cohere2_moe_settings_the_engine_cannot_run_are_refused_by_name(model_dir, tmp_path, changes, message):
    d = tmp_path / "m"
    shutil.copytree(model_dir("cohere2-moe"), d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=message) as refused:
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    assert str(d) in str(refused.value)


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)])
def test_longcat_zero_experts_skip_the_real_experts(device, dtype):
    """A slot routed to a zero expert adds its weight times the input and runs no real expert: with expert 0 (where
    such slots once went, at weight 0) never chosen and all NaN, the output is the one with expert 0 finite. On CUDA
    in bf16 too, where grouped_mm leaves the skipped slots' rows (past the experts' groups) unwritten."""
    from nanoinfer.models.longcat_flash import LongcatFlashMoE

    torch.manual_seed(0)
    moe = LongcatFlashMoE(make_config("longcat-flash"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.gate.e_score_correction_bias[0] = -10.0  # expert 0 never chosen; the zero experts (8 on) often are
        moe.to(device, dtype)
        x = torch.randn(40, moe.experts.w2_weight.shape[1], device=device, dtype=dtype)
        ids = moe.select_experts(x)[1]
        assert not (ids == 0).any() and (ids >= moe.experts.num_experts).any()
        finite = moe(x)
        moe.experts.w13_weight[0] = moe.experts.w2_weight[0] = float("nan")
        assert torch.equal(moe(x), finite)


class _QueriesAsOutput(torch.nn.Module):
    """Stands in for an Attention: each head's output is its query."""

    def forward(self, q, k, v, meta):
        return q


class _WidestPerToken(TorchDispatchMode):
    """The most elements per token of any tensor an op makes with a leading dimension of `rows` (tokens, or
    token-expert pairs) rows."""

    def __init__(self, tokens: int, rows: tuple[int, ...]):
        super().__init__()
        self.tokens, self.rows, self.widest = tokens, rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[0] in self.rows:
            self.widest = max(self.widest, out.numel() // self.tokens)
        return out


def test_jetmoe_attention_projects_each_token_through_its_chosen_experts_alone():
    """JetMoE's mixture of attention heads runs each token's k chosen experts' query and output projections, not all
    num_local_experts' (the 8 test experts' queries per token would be 8 x 32 wide): no tensor holds more per token
    than k queries or k hidden states."""
    from nanoinfer.models.jetmoe import JetMoeAttention
    from nanoinfer.models.llama import AttentionOptions

    config = make_config("jetmoe")
    torch.manual_seed(0)
    attn = JetMoeAttention(config, AttentionOptions())
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    attn.attn = _QueriesAsOutput()
    tokens, k = 50, config.num_experts_per_tok
    x = torch.randn(tokens, config.hidden_size)
    with _WidestPerToken(tokens, (tokens, tokens * k)) as widths:
        attn(None, x, None)
    query_width = config.num_key_value_heads * config.kv_channels
    assert config.num_local_experts * query_width > k * max(query_width, config.hidden_size)
    assert widths.widest <= k * max(query_width, config.hidden_size)
