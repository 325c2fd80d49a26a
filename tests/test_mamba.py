"""Mamba, Falcon-Mamba, Jamba and Zamba (the Mamba-1 mixer; Zamba's multi-head) vs transformers under chunked
prefill, preemption and two tensor-parallel ranks, prefix caching and LLM.embed refused; the selective scan's chunked
and one-step forms against each other, and the mixer against transformers' over prompt chunks, decode steps and several
sequences at once, whole and sharded over two ranks; Zamba's shared block and its refused options."""
import functools
import inspect

import pytest
import torch

from models import MAMBA1_KINDS
from nanoinfer import LLM
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.mamba import (MambaMixer, MambaSettings, MultiHeadMambaMixer, selective_scan,
                                    selective_state_update)
from nanoinfer.models.falcon_mamba import falcon_mamba_settings
from nanoinfer.models.jamba import jamba_mamba_settings
from nanoinfer.models.mamba import mamba_settings
from nanoinfer.models.zamba import ZambaForCausalLM, zamba_mamba_settings
from nanoinfer.models.zamba2 import Zamba2HybridLayer
from nanoinfer.utils.dist import tp_scope
# Prefix caching refused (a cached prefix has K/V but no recurrent state), LLM.embed refused (causal layers).
from test_qwen3_next import LOGIT_ATOL, PROMPTS, run, test_embed_is_refused, test_no_prefix_cache_reuse  # noqa: F401
from test_ssm import check_chunked_scan_against_steps, check_config_refused, run_in_steps, run_ranks, shard_over_ranks
from test_ssm import test_chunked_prefill_and_preemption_match_hf  # noqa: F401


@pytest.fixture(scope="module", params=MAMBA1_KINDS)
def ssm_dir(request, model_dir):
    """The model test_ssm's and test_qwen3_next's tests imported here run on."""
    return model_dir(request.param)


@pytest.fixture(scope="module")
def next_dir(ssm_dir):
    return ssm_dir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mamba", "jamba", "zamba"])
def test_tensor_parallel_2_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """Two ranks (a spawned worker): Mamba's vocabulary sharded, its mixers by channels, each rank with its
    channels' state; Jamba's attention and experts sharded too; Zamba's mixers by heads, its shared block's
    attention and MLP."""
    llm, _, worst = run(model_dir(kind), captured_logits, prompts=PROMPTS[:4], tensor_parallel_size=2)
    report_logit_diff(f"{kind}, tensor parallel 2", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    config = llm.llm_engine.config.hf_config
    channels = getattr(config, "mamba_expand", None) or config.expand
    mixers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, MambaMixer)]
    assert mixers and all(m.ssm_state[0].numel() * 2 == channels * config.hidden_size * m.state_size for m in mixers)


def _scan_inputs(n: int, channels: int = 6, state_size: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    dt = torch.nn.functional.softplus(randn(n, channels) - 1)
    A = -torch.logspace(-2, 0.5, channels * state_size, dtype=torch.float64).view(channels, state_size)
    return (randn(n, channels), dt, A, randn(n, state_size), randn(n, state_size), randn(channels),
            randn(channels, state_size))


@pytest.mark.parametrize("pieces", [[50], [1, 15, 16, 18], [7] * 7 + [1], [16, 16, 16, 2]])
@pytest.mark.parametrize("chunk_size", [16, 5, 1])
@pytest.mark.parametrize("parallel", [True, False])
def test_chunked_scan_matches_one_step_scan(pieces, chunk_size, parallel):
    """The chunked scan (prefill), parallel (GPUs) or not (CPUs) within chunks of any size, over a prompt split
    anywhere, equals the one-step form (decode) token by token."""
    scan = functools.partial(selective_scan, parallel=parallel)
    check_chunked_scan_against_steps(scan, selective_state_update, _scan_inputs(sum(pieces)), pieces, chunk_size)


def _hf_mixer(family: str) -> tuple[torch.nn.Module, MambaSettings]:
    """transformers' mixer of `family` (128 channels, 6 states, dt of rank 4; Zamba's in 4 heads) with random
    weights, and our settings for it."""
    import transformers

    common = dict(hidden_size=32, num_hidden_layers=1)
    if family == "zamba":
        from transformers.models.zamba.modeling_zamba import ZambaMambaMixer
        # (Its first 3 layers are fixed: Mamba, Mamba, hybrid.)
        config = transformers.ZambaConfig(**common | {"num_hidden_layers": 3}, mamba_d_state=6, mamba_dt_rank=4,
                                          mamba_expand=4, n_mamba_heads=4, mamba_proj_bias=True)
        hf, settings = ZambaMambaMixer(config, 0), zamba_mamba_settings(config)
    elif family == "jamba":
        from transformers.models.jamba.modeling_jamba import JambaMambaMixer
        config = transformers.JambaConfig(**common, mamba_d_state=6, mamba_dt_rank=4, mamba_expand=4,
                                          mamba_proj_bias=True, attn_layer_offset=1, attn_layer_period=2)
        hf, settings = JambaMambaMixer(config, 0), jamba_mamba_settings(config)
    else:
        config_class = transformers.MambaConfig if family == "mamba" else transformers.FalconMambaConfig
        config = config_class(**common, state_size=6, time_step_rank=4, expand=4, use_bias=True)
        module = transformers.models.mamba.modeling_mamba if family == "mamba" else (
            transformers.models.falcon_mamba.modeling_falcon_mamba)
        mixer_class = module.MambaMixer if family == "mamba" else module.FalconMambaMixer
        # transformers 5.23's Falcon-Mamba mixer cannot initialize its own weights (its norms come after); they are
        # set below. (5.17's has no such option; 5.25's class decorator hides its signature: read in its source.)
        skip_init = "initialize_mixer_weights" in inspect.getsource(mixer_class)
        hf = mixer_class(config, 0, **({"initialize_mixer_weights": False} if skip_init else {}))
        settings = (mamba_settings if family == "mamba" else falcon_mamba_settings)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        hf.A_log.copy_(torch.linspace(0.01, 1.0, hf.A_log.numel()).log().view_as(hf.A_log))
        dt_bias = hf.dt_proj_bias if family == "zamba" else hf.dt_proj.bias
        dt_bias.copy_(-2.0 + 0.5 * torch.randn(dt_bias.shape, generator=g))
    return hf, settings


def _our_mixer(family: str, settings: MambaSettings) -> MambaMixer:
    return (MultiHeadMambaMixer if family == "zamba" else MambaMixer)(settings)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba", "zamba"])
@torch.inference_mode()
def test_mixer_matches_transformers_over_chunks_steps_and_sequences(family):
    """Three sequences in the same steps (slots 3, 0, 2): one prefilled whole, one in prompt chunks then decode steps
    (in the same steps as another's chunks), one decoded from its first token; each equals transformers' mixer over
    its whole sequence (its sequential scan)."""
    hf, settings = _hf_mixer(family)
    ours = _our_mixer(family, settings)
    weights = hf.state_dict()
    assert {name for name, _ in ours.named_parameters()} == set(weights)
    for name, p in ours.named_parameters():
        p.data.copy_(weights[name])
    ours.allocate_state(4, torch.float32, torch.device("cpu"))
    x, expected = _inputs_and_hf_outputs(hf)
    check_outputs(run_in_steps(ours, x, first_prefill=70), expected)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba", "zamba"])
@torch.inference_mode()
def test_mixer_sharded_over_two_ranks_matches_transformers(family, monkeypatch):
    """Two ranks (threads in a fake group): each holds half the channels (their in_proj rows, conv, dt_proj rows
    and state, x_proj's and out_proj's input columns); x_proj's partial dt, B and C all-reduced before their norms
    (Falcon-Mamba's, Jamba's), out_proj's after; Zamba's half the heads, each with its whole x_proj and dt_proj;
    their outputs equal transformers' mixer's."""
    hf, settings = _hf_mixer(family)
    ranks = shard_over_ranks(lambda: _our_mixer(family, settings), hf, 2)
    half = settings.intermediate_size // 2
    for mixer in ranks:
        assert mixer.ssm_state[0].numel() == half * settings.state_size and mixer.conv_state.shape[-1] == half
        assert mixer.in_proj.weight.shape[0] == 2 * half
        assert mixer.x_proj_weight.shape[0] * 2 == settings.n_heads if family == "zamba" else (
            mixer.x_proj.weight.shape[1] == half)
    x, expected = _inputs_and_hf_outputs(hf)
    for outputs in run_ranks(monkeypatch, [lambda m=m: run_in_steps(m, x, first_prefill=70) for m in ranks]):
        check_outputs(outputs, expected)


def test_mixer_channels_must_split_over_ranks():
    with tp_scope(0, 3, None), pytest.raises(ValueError, match="intermediate_size=128 .* tensor_parallel_size=3"):
        MambaMixer(_hf_mixer("mamba")[1])
    with tp_scope(0, 8, None), pytest.raises(ValueError, match="n_mamba_heads=4 .* tensor_parallel_size=8"):
        MultiHeadMambaMixer(_hf_mixer("zamba")[1])  # 16 channels a rank, but half a head


def _inputs_and_hf_outputs(hf) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences of 70, 19 and 6 tokens, and transformers' mixer's outputs over each whole (its sequential
    scan)."""
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(n, 32, generator=g) for n in (70, 19, 6)]
    return x, [hf(seq[None])[0] for seq in x]


def check_outputs(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    # fp32 rounding of outputs of up to some hundreds (transformers' own).
    for y, want in zip(got, expected):
        torch.testing.assert_close(y, want, rtol=0, atol=1e-6 * want.abs().max().item())
        assert want.abs().max() > 1


def test_zamba_shares_its_block_with_a_cache_per_invocation(model_dir):
    """Zamba's hybrid layers 2 and 4 invoke its one shared block (no adapters, stored once under layer 2), each
    invocation with its own KV cache and linear."""
    with LLM(str(model_dir("zamba")), device="cpu", dtype="float32", max_model_len=64) as llm:
        model = llm.llm_engine.model_runner.model
        assert isinstance(model, ZambaForCausalLM)
        layers = model.model.layers
        hybrid = [i for i, layer in enumerate(layers) if isinstance(layer, Zamba2HybridLayer)]
        assert hybrid == [2, 4] and layers[2].shared_transformer is layers[4].shared_transformer
        block = layers[2].shared_transformer
        assert not block.self_attn.adapted and block.feed_forward.gate_up_proj_adapter_list is None
        caches = [m for m in model.modules() if isinstance(m, Attention)]
        assert {id(c) for c in caches} == {id(layers[i].attn) for i in hybrid} and len(caches) == 2
        assert layers[2].linear is not layers[4].linear


@pytest.mark.parametrize("change, option", [({"attention_hidden_size": 96}, "attention_hidden_size=96"),
                                            ({"attention_head_dim": 16}, "attention_head_dim=16"),
                                            ({"hidden_mamba_act": "gelu"}, "hidden_mamba_act='gelu'")])
def test_zamba_unsupported_config_is_refused(model_dir, tmp_path, change, option):
    """Shapes and options transformers' Zamba lets vary and ours assumes are refused by name, with the model's path."""
    check_config_refused(model_dir("zamba"), tmp_path, change, option)
