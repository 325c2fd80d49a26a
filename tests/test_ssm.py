"""LFM2, LFM2-MoE, Bamba, Granite 4.0-H, NemotronH, Falcon-H1 and Zamba2 (short-conv and Mamba2 hybrids), RecurrentGemma
(RG-LRU), RWKV, Mamba2, xLSTM and the newest hybrids (NEWEST_HYBRID_KINDS) vs transformers under chunked prefill,
preemption and two tensor-parallel ranks, prefix caching and LLM.embed refused; the Mamba2 scan's chunked and one-step
forms against each other, and the mixers against transformers' over prompt chunks, decode steps and several sequences
at once, whole and sharded over two ranks; Zamba2's shared blocks, Ling's hybrid from a Hub-form config, Qwen4-Exp's
n-grams across EOS, and the options (and checkpoints) Zamba2, Ling's hybrid, ZAYA, RecurrentGemma, xLSTM and Qwen4-Exp
refuse."""
import inspect
import json
import pathlib
import re
import shutil
import threading
from collections.abc import Callable

import pytest
import torch

from models import (MAMBA2_HYBRID_KINDS, NEWEST_HYBRID_KINDS, SSM_KINDS, XLSTM_KIND, hf_greedy, load_hf_model,
                    make_config, random_prompts)
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings, ssd_chunk_scan, ssd_step
from nanoinfer.layers.recurrent import RecurrentBatch, RecurrentLayer
from nanoinfer.models import falcon_h1, nemotron_h, xlstm, zamba2
from nanoinfer.models.bamba import mamba2_settings
from nanoinfer.models.xlstm import MLSTMLayer
from nanoinfer.utils.dist import tp_scope
from nanoinfer.utils.loader import load_weights
from test_qwen3_next import GREEDY, LOGIT_ATOL, PROMPTS, run
# Prefix caching refused (a cached prefix has K/V but no recurrent state), LLM.embed refused (causal layers).
from test_qwen3_next import test_embed_is_refused, test_no_prefix_cache_reuse  # noqa: F401


@pytest.fixture(scope="module", params=SSM_KINDS + MAMBA2_HYBRID_KINDS + NEWEST_HYBRID_KINDS + (XLSTM_KIND,))
def ssm_dir(request, model_dir):
    return model_dir(request.param)


@pytest.fixture(scope="module")
def next_dir(ssm_dir):
    """The model test_qwen3_next's tests imported here run on."""
    return ssm_dir


def test_chunked_prefill_and_preemption_match_hf(ssm_dir, captured_logits, report_logit_diff):
    # A 7-token budget ends prompt chunks anywhere (in and across 16-token scan chunks), carried over in the state;
    # 3 slots for 7 prompts reuse slots (a stale state must be reset). Then a cache too small for all sequences:
    # preempted ones lose their state and recompute from scratch.
    llm, _, chunked = run(ssm_dir, captured_logits, max_num_batched_tokens=7, max_num_seqs=3)
    assert llm.llm_engine.model_runner.num_state_slots == 3
    llm, _, preempted = run(ssm_dir, captured_logits, num_kvcache_blocks=8, max_num_batched_tokens=64)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    report_logit_diff(f"{ssm_dir.name}, chunked prefill / preemption", max(chunked, preempted))
    assert max(chunked, preempted) < LOGIT_ATOL, f"max |logit diff| {chunked:.2e} / {preempted:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lfm2", "granitemoehybrid", "nemotron-h", "falcon-h1-norm", "bamba", "zamba2",
                                  "mamba2", "lfm2-moe", "recurrent-gemma", "rwkv", *NEWEST_HYBRID_KINDS, XLSTM_KIND])
def test_tensor_parallel_2_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker): LFM2's short conv sharded by channels (LFM2-MoE's experts too), RecurrentGemma's
    RG-LRU by heads (its one KV head replicated), RWKV's time mix by channels and its channel mix as an MLP; Granite's,
    NemotronH's, Falcon-H1's, Bamba's and Zamba2's attention, MLPs and experts sharded, their Mamba2 mixers (Mamba2's
    alone) by heads, each rank with its heads' state (Falcon-H1's multipliers folded into each rank's rows; Bamba's one
    group of B and C whole on both ranks; Zamba2's adapters' B rows split as the projections they add to); xLSTM's
    mLSTM layers by heads, each rank with its heads' matrix memories; Qwen4-Exp's n-gram tables by rows."""
    llm, _, worst = run(model_dir(kind), captured_logits, prompts=PROMPTS[:4], tensor_parallel_size=2)
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    config = llm.llm_engine.config.hf_config
    heads = next((getattr(config, name) for name in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
                  if getattr(config, name, None)), None)
    mixers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, (Mamba2Mixer, MLSTMLayer))]
    assert bool(mixers) == (kind not in ("lfm2", "lfm2-moe", "recurrent-gemma", "rwkv", *NEWEST_HYBRID_KINDS))
    assert all(m.ssm_state.shape[1] * 2 == heads for m in mixers)
    tables = [m.ngram_embedding for m in llm.llm_engine.model_runner.model.modules() if hasattr(m, "ngram_embedding")]
    assert bool(tables) == (kind == "qwen4-exp")
    assert all(t.weight.shape[0] * 2 == t.num_embeddings for t in tables)


def _scan_inputs(n: int, heads: int = 4, groups: int = 2, head_dim: int = 3, state_size: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    dt = torch.nn.functional.softplus(randn(n, heads) - 1)
    A = -torch.tensor([0.01, 0.1, 0.5, 2.0], dtype=torch.float64)  # decays from almost none to strong
    return (randn(n, heads, head_dim), dt, A, randn(n, groups, state_size), randn(n, groups, state_size),
            randn(heads), randn(heads, head_dim, state_size))


@pytest.mark.parametrize("pieces", [[50], [1, 15, 16, 18], [7] * 7 + [1], [16, 16, 16, 2]])
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_chunked_scan_matches_one_step_scan(pieces, chunk_size):
    """The chunked form (prefill), over a prompt split anywhere, equals the one-step form (decode) token by token."""
    check_chunked_scan_against_steps(ssd_chunk_scan, ssd_step, _scan_inputs(sum(pieces)), pieces, chunk_size)


def check_chunked_scan_against_steps(chunked, step, inputs: tuple[torch.Tensor, ...], pieces: list[int],
                                     chunk_size: int) -> None:
    """chunked(x, dt, A, B, C, D, state, chunk_size) -> (y, state), over the tokens of `inputs` split into `pieces`,
    equals step(x, dt, A, B, C, D, states) (states updated in place) token by token."""
    x, dt, A, B, C, D, state = inputs
    expected_state, expected = state.clone()[None], []
    for t in range(x.shape[0]):
        expected.append(step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, expected_state))
    out, start = [], 0
    for n in pieces:
        s = slice(start, start + n)
        y, state = chunked(x[s], dt[s], A, B[s], C[s], D, state, chunk_size)
        out.append(y)
        start += n
    torch.testing.assert_close(torch.cat(out), torch.cat(expected), rtol=0, atol=1e-10)
    torch.testing.assert_close(state, expected_state[0], rtol=0, atol=1e-10)
    assert expected_state.abs().max() > 0.1


def _metadata(query_lens: list[int], context_lens: list[int], slots: list[int]) -> AttentionMetadata:
    cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(None, torch.zeros(len(slots), 1, dtype=torch.int32),
                             torch.tensor(context_lens, dtype=torch.int32), cu, cu, max(query_lens),
                             max(context_lens), 16, state_slots=torch.tensor(slots))


def _hf_mixer(kind: str, n_groups: int = 2) -> tuple[torch.nn.Module, Mamba2Settings, object]:
    """transformers' mixer of `kind` (8 or 6 heads in n_groups groups, 5-token scan chunks) with random weights, our
    settings for it, and its config."""
    hf, settings, config = _hf_mixer_and_settings(kind, n_groups)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        hf.A_log.copy_(torch.linspace(0.01, 1.0, hf.A_log.numel()).log())
    return hf, settings, config


def _hf_mixer_and_settings(kind: str, n_groups: int) -> tuple[torch.nn.Module, Mamba2Settings, object]:
    """transformers' mixer of `kind` as it initializes itself, our settings for it, and its config."""
    if kind == "bamba":
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaMixer, BambaRMSNormGated

        if n_groups > 1 and "group_size" not in inspect.signature(BambaRMSNormGated).parameters:
            pytest.skip("this transformers' Bamba normalizes the gated norm over all groups at once (5.17 does; "
                        "mamba_ssm and later transformers, which we follow, per group); Bamba's checkpoints have 1")
        config = BambaConfig(hidden_size=32, mamba_n_heads=8, mamba_d_state=6, mamba_n_groups=n_groups,
                             mamba_chunk_size=5, num_hidden_layers=1, attn_layer_indices=[])
        return BambaMixer(config, 0), mamba2_settings(config), config
    if kind == "nemotron-h":  # dt's floor binds for ~1 in 10 head-steps; projection biases
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

        config = NemotronHConfig(hidden_size=32, layers_block_type=["linear_attention"], mamba_num_heads=8,
                                 mamba_head_dim=8, n_groups=n_groups, ssm_state_size=6, chunk_size=5, time_step_min=0.1,
                                 time_step_limit=(0.1, float("inf")), use_bias=True)  # 5.23's floor, 5.25's
        return NemotronHMamba2Mixer(config, 0), nemotron_h.mamba2_settings(config), config
    if kind == "zamba2":  # the conv's bias whatever use_conv_bias says, the gated norm's own eps, dt floored
        from transformers import Zamba2Config
        from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

        config = Zamba2Config(hidden_size=32, n_mamba_heads=8, mamba_d_state=6, mamba_ngroups=n_groups, chunk_size=5,
                              num_hidden_layers=1, layers_block_type=["linear_attention"], time_step_min=0.1,
                              use_conv_bias=False, add_bias_linear=True, rms_norm_eps=1e-3)
        return Zamba2MambaMixer(config, 0), zamba2.mamba2_settings(config), config
    # Falcon-H1: the gate alone, or the gated norm before the gate; mamba_d_ssm channels (not 2 x hidden).
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer

    config = FalconH1Config(hidden_size=32, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=6, mamba_n_groups=n_groups,
                            mamba_chunk_size=5, num_hidden_layers=1, mamba_rms_norm=kind == "falcon-h1-norm",
                            mamba_norm_before_gate=True, mamba_proj_bias=True, projectors_bias=True)
    hf = FalconH1Mixer(config, 0)
    hf.register_buffer("mup_vector", torch.ones(hf.in_proj.out_features))  # the model's; its multipliers: 1
    return hf, falcon_h1.mamba2_settings(config), config


@pytest.fixture(scope="module", params=["bamba", "nemotron-h", "falcon-h1", "falcon-h1-norm", "zamba2"])
def mixers(request):
    """transformers' mixer, ours with its weights, and its config."""
    hf, settings, config = _hf_mixer(request.param)
    ours = Mamba2Mixer(settings)
    weights = hf.state_dict()
    for name, p in ours.named_parameters():
        p.data.copy_(weights[name])
    ours.allocate_state(4, torch.float32, torch.device("cpu"))
    return hf, ours, config


@torch.inference_mode()
def test_mixer_matches_transformers_over_chunks_steps_and_sequences(mixers):
    """Three sequences in the same steps (slots 3, 0, 2): one prefilled whole, one in prompt chunks then decode steps
    (in the same steps as another's chunks), one decoded from its first token; each equals transformers' mixer run
    over the same pieces with its cache (its chunked form for pieces of several tokens, its one-step form for one)."""
    hf, ours, config = mixers
    x, expected = _inputs_and_hf_outputs(hf, config)
    for got, want in zip(run_in_steps(ours, x, first_prefill=23), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _inputs_and_hf_outputs(hf, config) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences of 23, 19 and 6 tokens, and transformers' mixer's outputs over each one's pieces of
    step_schedule(23) (its chunked form for pieces of several tokens, its one-step form for one) with its cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    x = [torch.randn(n, 32, generator=g) for n in (23, 19, 6)]
    expected = []
    for i, seq in enumerate(x):
        cache = DynamicCache(config=config)
        pieces = [n for n in (step[i] for step in step_schedule(23)) if n]
        expected.append(torch.cat([hf(piece[None], cache_params=cache)[0] for piece in seq.split(pieces)]))
    return x, expected


@pytest.mark.parametrize("kind, n_groups", [("bamba", 2), ("nemotron-h", 2), ("falcon-h1-norm", 3), ("falcon-h1", 3),
                                            ("bamba", 1), ("zamba2", 2)])
@torch.inference_mode()
def test_mixer_sharded_over_two_ranks_matches_transformers(kind, n_groups, monkeypatch):
    """Two ranks (threads in a fake group): each holds half the heads (their in_proj rows, conv channels and state)
    and half the groups of B and C, or all of them where 2 does not divide them (3 groups: a norm group spans both
    ranks; 1: one norm over all channels); their all-reduced outputs equal transformers' mixer's."""
    hf, settings, config = _hf_mixer(kind, n_groups)
    ranks = shard_over_ranks(lambda: Mamba2Mixer(settings), hf, 2)
    groups = n_groups * settings.state_size // (2 if n_groups % 2 == 0 else 1)  # rows of B (and of C) per rank
    half = settings.intermediate_size // 2
    for mixer in ranks:
        assert mixer.ssm_state.shape[1:] == (settings.num_heads // 2, settings.head_dim, settings.state_size)
        assert mixer.conv_state.shape[-1] == half + 2 * groups
        assert mixer.in_proj.weight.shape[0] == 2 * half + 2 * groups + settings.num_heads // 2
        assert mixer.out_proj.weight.shape[1] == half
    x, expected = _inputs_and_hf_outputs(hf, config)
    for outputs in run_ranks(monkeypatch, [lambda m=m: run_in_steps(m, x, first_prefill=23) for m in ranks]):
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_mixer_heads_must_split_over_ranks():
    settings = _hf_mixer_and_settings("nemotron-h", 2)[1]
    with tp_scope(0, 3, None), pytest.raises(ValueError, match="8 Mamba2 heads do not split over tensor_parallel_size"):
        Mamba2Mixer(settings)


def shard_over_ranks(make: Callable[[], torch.nn.Module], hf: torch.nn.Module, size: int) -> list[torch.nn.Module]:
    """make() as each of `size` tensor-parallel ranks, loaded by its weight_loaders from hf's parameters (of the
    same names), with 4 state slots in each of its recurrent layers."""
    layers = []
    for rank in range(size):
        with tp_scope(rank, size, None), torch.no_grad():
            layer = make()
            load_weights(layer, hf.named_parameters())
        for m in layer.modules():
            if isinstance(m, RecurrentLayer):
                m.allocate_state(4, torch.float32, torch.device("cpu"))
        layers.append(layer)
    return layers


def run_ranks(monkeypatch, work: list[Callable[[], object]]) -> list[object]:
    """Each rank's work at once, in a thread of its own, torch.distributed.all_reduce (monkeypatched) summing the
    ranks' tensors in place, in the same order on every rank: a fake group of len(work) ranks."""
    size = len(work)
    barrier, local, tensors, results, errors = threading.Barrier(size, timeout=60), threading.local(), {}, {}, []

    def all_reduce(tensor: torch.Tensor, group=None) -> None:
        tensors[local.rank] = tensor
        barrier.wait()
        total = sum((tensors[r] for r in range(1, size)), tensors[0].clone())
        barrier.wait()  # every rank has read every other's tensor
        tensor.copy_(total)

    def run(rank: int) -> None:
        local.rank = rank
        try:
            with torch.inference_mode():  # thread-local
                results[rank] = work[rank]()
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[rank] for rank in range(size)]


def step_schedule(first_prefill: int) -> list[list[int]]:
    """Tokens per sequence per step of run_in_steps."""
    return [[first_prefill, 7, 1], [0, 5, 1], [0, 1, 1], [0, 4, 1], [0, 1, 1], [0, 1, 1]]


def run_in_steps(mixer, x: list[torch.Tensor], first_prefill: int) -> list[torch.Tensor]:
    """The mixer's outputs over three sequences x (in slots 3, 0, 2) in the same steps: the first prefilled whole
    (first_prefill tokens), the second in prompt chunks then decode steps, the third decoded from its first token."""
    steps = step_schedule(first_prefill)
    done, out = [0, 0, 0], [[], [], []]
    for counts in steps:
        live = [i for i in range(3) if counts[i]]
        rows = torch.cat([x[i][done[i]:done[i] + counts[i]] for i in live])
        meta = _metadata([counts[i] for i in live], [done[i] + counts[i] for i in live], [[3, 0, 2][i] for i in live])
        y = mixer(rows, RecurrentBatch.from_metadata(meta)).split([counts[i] for i in live])
        for i, part in zip(live, y):
            out[i].append(part)
            done[i] += counts[i]
    assert done == [len(seq) for seq in x]
    return [torch.cat(parts) for parts in out]


def test_zamba2_shares_its_blocks_with_a_cache_per_invocation(model_dir, tmp_path):
    """Zamba2's 3 hybrid layers invoke its 2 shared blocks in rotation: layers 0 and 3 hold one and the same block,
    whose weights exist once (its checkpoint holds them under layer 0); each invocation has its own KV cache,
    adapters (inside the block, by invocation) and linear. A checkpoint that also holds the block's copy under layer
    3 (a save that keeps tied copies) loads the same and gives the same tokens."""
    from safetensors.torch import load_file, save_file

    d = model_dir("zamba2")
    weights = load_file(d / "model.safetensors")
    assert not any(name.startswith("model.layers.3.shared_transformer.") for name in weights)
    copied = tmp_path / "zamba2-copies"
    copied.mkdir()
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (copied / f.name).write_bytes(f.read_bytes())
    prefix = "model.layers.0.shared_transformer."
    save_file({**weights, **{name.replace(prefix, "model.layers.3.shared_transformer."): w.clone()
                             for name, w in weights.items() if name.startswith(prefix)}},
              copied / "model.safetensors")
    tokens = []
    for path in (d, copied):
        with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
            model = llm.llm_engine.model_runner.model
            layers = model.model.layers
            hybrid = [layer for layer in layers if isinstance(layer, zamba2.Zamba2HybridLayer)]
            assert [layer.invocation for layer in hybrid] == [0, 1, 2]
            assert layers[0].shared_transformer is layers[3].shared_transformer is not layers[2].shared_transformer
            block = layers[0].shared_transformer
            assert sorted(block.self_attn.linear_q_adapter_list) == sorted(block.feed_forward.gate_up_proj_adapter_list
                                                                           ) == ["0", "2"]
            names = {name for name, _ in model.named_parameters()}
            assert not any(".layers.3.shared_transformer." in name for name in names)
            assert {"model.layers.3.linear.weight", "model.layers.3.mamba_decoder.mixer.A_log"} <= names
            caches = [m for m in model.modules() if isinstance(m, Attention)]
            assert len(caches) == 3 and {id(c) for c in caches} == {id(layer.attn) for layer in hybrid}
            assert len({c.k_cache.data_ptr() for c in caches}) == 3
            tokens.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("change, option", [({"num_key_value_heads": 2}, "use_shared_attention_adapter"),
                                            ({"use_shared_mlp_adapter": False}, "use_shared_mlp_adapter"),
                                            ({"num_attention_heads": 3}, "num_attention_heads=3")])
def test_zamba2_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """Options transformers' Zamba2 cannot run (k and v adapters narrower than their input) or ignores are refused
    by name, with the model's path; the engine is not built."""
    check_config_refused(model_dir("zamba2"), tmp_path, change, option)


def check_config_refused(model: pathlib.Path, tmp_path: pathlib.Path, change: dict, option: str) -> None:
    """A copy of `model` with `change` in its config.json: LLM raises a ValueError naming `option` and the copy."""
    d = shutil.copytree(model, tmp_path / model.name)
    config = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(option)) as e:
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)
    assert str(d) in str(e.value)


def test_bailing_hybrid_hub_config_and_unbounded_gate_match_hf(model_dir, tmp_path, captured_logits,
                                                               report_logit_diff):
    """Ling's hybrid with a config in the Hub's form (layer and MLP types derived from layer_group_size and
    first_k_dense_replace, as transformers derives them), KDA's unbounded forget gate (kda_safe_gate false: Kimi's
    softplus decay), and a checkpoint that also holds its multi-token-prediction layer (numbered after the last
    decoder layer), which both ignore."""
    from safetensors.torch import load_file, save_file

    src = model_dir("bailing-hybrid")
    d = shutil.copytree(src, tmp_path / "bailing-hub")
    config = json.loads((d / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    del config["layer_types"], config["mlp_layer_types"]
    config |= {"layer_group_size": 2, "first_k_dense_replace": 1, "kda_safe_gate": False, "num_nextn_predict_layers": 1}
    (d / "config.json").write_text(json.dumps(config))
    weights = load_file(d / "model.safetensors")
    mtp = {name.replace("model.layers.2.", "model.layers.3."): w.clone() for name, w in weights.items()
           if name.startswith("model.layers.2.")}
    save_file(weights | mtp, d / "model.safetensors", metadata={"format": "pt"})
    llm, _, worst = run(d, captured_logits, prompts=PROMPTS[:4])
    report_logit_diff("bailing-hybrid, Hub config, unbounded gate", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("change, option", [({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
                                            ({"hidden_act": "gelu"}, "hidden_act='gelu'")])
def test_bailing_hybrid_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """transformers' Ling hybrid never ties lm_head to the embedding (its checkpoints hold both); KDA's conv applies
    hidden_act, and only SiLU is implemented."""
    check_config_refused(model_dir("bailing-hybrid"), tmp_path, change, option)


@pytest.mark.parametrize("change, option", [({"hidden_act": "gelu"}, "hidden_act='gelu'"),
                                            ({"layer_types": ["hybrid", "full_attention", "hybrid"]},
                                             "layer_types[1]='full_attention'")])
def test_zaya_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """ZAYA's experts are SwiGLU MLPs (transformers' apply hidden_act); its layers are CCA attention, full or
    sliding."""
    check_config_refused(model_dir("zaya"), tmp_path, change, option)


def test_zaya_skip_bias_is_transformers_minus_one_whatever_the_checkpoint_holds(model_dir, tmp_path, captured_logits,
                                                                                report_logit_diff):
    """transformers' ZAYA sets the skip class's balancing bias to -1 after loading (its _init_weights), whatever the
    checkpoint holds: a checkpoint whose skip biases are +1 (every token skipping, if they were honoured) gives
    transformers' tokens."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(model_dir("zaya"), tmp_path / "zaya-skip")
    weights = load_file(d / "model.safetensors")
    biases = [name for name in weights if name.endswith("balancing_biases")]
    assert biases
    for name in biases:
        weights[name][-1] = 1.0
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    llm, _, worst = run(d, captured_logits, prompts=PROMPTS[:4])
    llm.close()
    report_logit_diff("zaya, skip biases of +1 in the checkpoint", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("change, option", [({"block_types": ["recurrent", "mlp"]}, "block_types[1]='mlp'"),
                                            ({"lru_width": 66}, "lru_width=66")])
def test_recurrent_gemma_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """transformers runs a block type it does not know as attention; the RG-LRU's width splits into one block per
    attention head."""
    check_config_refused(model_dir("recurrent-gemma"), tmp_path, change, option)


def test_recurrent_gemma_empty_block_types_are_refused(model_dir):
    """The layers repeat block_types, which cannot be empty: refused by name (transformers 5.23's config refuses an
    empty list itself, so the config is emptied after it is read, as one its validation does not see)."""
    from transformers import AutoConfig

    from nanoinfer.models.recurrent_gemma import RecurrentGemmaForCausalLM

    d = model_dir("recurrent-gemma")
    config = AutoConfig.from_pretrained(d)
    config.block_types = []
    with pytest.raises(ValueError, match=re.escape("block_types=[]")) as e:
        RecurrentGemmaForCausalLM(config)
    assert str(d) in str(e.value)


@pytest.mark.parametrize("change, option", [({"weight_mode": "fused"}, "weight_mode='fused'"),
                                            ({"use_bias": True}, "use_bias=True")])
def test_xlstm_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """xLSTM's fused projections (`qkv_opreact`, `ifgate_preact`, `proj_up_gate_z`) and biases, which no released
    checkpoint has, are refused rather than loaded under other names."""
    check_config_refused(model_dir(XLSTM_KIND), tmp_path, change, option)


def test_qwen4_exp_ngrams_restart_after_eos(model_dir, captured_logits, report_logit_diff):
    """Qwen4-Exp's n-gram contexts start over after an EOS (the tokens before it read as EOS): prompts holding EOS
    first, last, twice in a row and one token apart, in 5-token chunks that end beside them."""
    d = model_dir("qwen4-exp")  # first: it skips where transformers lacks the family (and its config)
    eos = make_config("qwen4-exp").eos_token_id
    prompts = [[eos, 5, 6, 7, eos, eos, 8, 9, 10, 11, eos, 12, eos, 13] * 3, [20, 21, 22, eos],
               [30, eos, 31, 32, 33, 34, eos, 35, 36]]
    llm, _, worst = run(d, captured_logits, prompts=prompts, max_num_batched_tokens=5)
    report_logit_diff("qwen4-exp, EOS inside prompts", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("change, option", [(dict.fromkeys(("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                                             "indexer_budget", "indexer_compress_ratio")),
                                             "indexer_n_heads=None"),
                                            ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
                                            ({"split_ngram_parts": 3}, "split_ngram_parts=3")])
def test_qwen4_exp_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """Qwen4-Exp without its QSA indexer (transformers' attention always builds one), with an activation other than
    the delta rule's SiLU, or with n-gram tables in other parts than its config says."""
    check_config_refused(model_dir("qwen4-exp"), tmp_path, change, option)


def test_qwen4_exp_checkpoint_hashing_otherwise_is_refused(model_dir, tmp_path):
    """The n-gram hash buffers transformers saves must be those the config derives (they are not loaded)."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(model_dir("qwen4-exp"), tmp_path / "qwen4-hash")
    weights = load_file(d / "model.safetensors")
    name = "model.layers.2.ple.ple_embedding.layer_multipliers"
    weights[name][1] += 2
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name)):
        LLM(str(d), device="cpu", dtype="float32", max_model_len=64)


def test_rwkv_rescale_in_fp16_divides_the_weights(model_dir, tmp_path):
    """rescale_every is for fp16: transformers divides block b's `output` and `value` weights by 2^(b // rescale_every),
    so that their products stay finite. Block 3's channel-mix value scaled up until its product overflows fp16
    undivided (~13 x 3000 x 2) but not divided by 2: the engine's fp16 greedy tokens are transformers' fp16 ones."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(model_dir("rwkv"), tmp_path / "rwkv")
    weights = load_file(d / "model.safetensors")
    weights["rwkv.blocks.3.feed_forward.value.weight"] *= 3000.0
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(4, 5, 440, 2, 60, seed=11)
    refs = hf_greedy(load_hf_model(d, torch.float16), prompts, 8)
    assert all(torch.isfinite(ref["logits"]).all() for ref in refs)
    with LLM(str(d), device="cpu", dtype="float16", max_model_len=128) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [ref["token_ids"] for ref in refs]


def test_xlstm_block_form_is_transformers_recurrence():
    """The mLSTM over a 300-token prompt in the engine's 64-token blocks (the last one partial), whole and as chunks
    of 100 and 200 (a cut inside a block, the state carried), from a state 50 earlier tokens left, against
    transformers' one-step recurrence (mlstm_recurrent_sequence_native) in fp64: outputs and the final C, n and m
    agree to rounding. Gates as a trained model's: soft-capped, forget gates biased towards remembering, so that the
    stabilizer m comes from the carried state and from tokens within a block alike."""
    from transformers.models.xlstm import modeling_xlstm

    g = torch.Generator().manual_seed(0)
    tokens, heads, dk, dv = 350, 4, 8, 16
    q, k = (torch.randn(tokens, heads, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(tokens, heads, dv, generator=g, dtype=torch.float64)
    i = xlstm.soft_cap(3 * torch.randn(tokens, heads, generator=g, dtype=torch.float64), 15.0)
    f = xlstm.soft_cap(3 * torch.randn(tokens, heads, generator=g, dtype=torch.float64) + 3, 15.0)

    def hf(start: int, end: int, state: tuple | None) -> tuple[torch.Tensor, tuple]:
        rows = (t[start:end].transpose(0, 1)[None] for t in (q, k, v, i, f))
        h, state = modeling_xlstm.mlstm_recurrent_sequence_native(*rows, *(state or (None,) * 3), eps=1e-6,
                                                                  return_last_states=True, dtype_state=torch.float64)
        return h[0].transpose(0, 1), state

    _, before = hf(0, 50, None)
    ref, (C, n, m) = hf(50, tokens, before)
    state = torch.zeros(heads, dk + 1, dv + 1, dtype=torch.float64)
    for view, part in zip(xlstm.state_views(state), before):
        view.copy_(part[0].view(view.shape))
    for cuts in ((50, tokens), (50, 150, tokens)):
        h, carried = [], state
        for start, end in zip(cuts, cuts[1:]):
            out, carried = xlstm.mlstm_sequence(*(t[start:end] for t in (q, k, v, i, f)), carried, 1e-6)
            h.append(out)
        torch.testing.assert_close(torch.cat(h), ref, rtol=1e-10, atol=1e-10)
        for ours, theirs in zip(xlstm.state_views(carried), (C, n, m)):
            torch.testing.assert_close(ours, theirs[0].view(ours.shape), rtol=1e-10, atol=1e-10)


def test_a_prefill_steps_recurrent_batch_reads_the_host_metadata_not_the_devices():
    """Outside decode, each step's spans and slots come from the metadata the host built (InputBatch.to_device keeps
    it as meta.host): read back from the device, they would wait for all the work queued before them (async
    scheduling's overlap lost). The device tensors here are on the meta device, which has no values to read."""
    host = AttentionMetadata(slot_mapping=torch.arange(7), block_tables=torch.zeros(3, 1, dtype=torch.int32),
                             context_lens=torch.tensor([4, 1, 9], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 4, 5, 7], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 4, 5, 14], dtype=torch.int32), max_seqlen_q=4,
                             max_seqlen_k=9, block_size=16, state_slots=torch.tensor([2, 0, 5]))
    device = host.to(torch.device("meta"))
    device.state_slots = host.state_slots.to("meta")
    batch = RecurrentBatch.from_metadata(device)
    assert batch.spans == [(0, 4, 2), (5, 7, 5)] and batch.single_rows.device.type == "meta"
    assert batch.fresh_slots.shape == (2,) and batch.single_slots.shape == (1,)  # slots 2 and 0 start at 0; 0 alone
