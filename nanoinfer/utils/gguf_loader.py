"""Load llama.cpp GGUF checkpoints (architectures in SUPPORTED_ARCHS) as a transformers config,
tokenizer and float32 weights named like a Hugging Face safetensors checkpoint."""
from __future__ import annotations  # gguf's types in signatures stay unevaluated when gguf is missing

import functools
import os
import pathlib
import warnings
from typing import Iterator, TypeVar

try:
    import gguf
except ImportError:  # only .gguf checkpoints need it: `_reader` says so when one is opened without it
    gguf = None
import numpy as np
import torch
import transformers
from transformers import (AutoConfig, AutoTokenizer, GptOssConfig, PretrainedConfig, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)

# GGUF `general.architecture` values we can load.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3", "stablelm",
                   "starcoder2", "gpt2", "falcon", "mamba", "nemotron", "lfm2", "gpt-oss")
# Keyed by HF model_type: transformers turns a "llama" GGUF whose name mentions mistral into a
# MistralConfig, which has the same weights.
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                    "stablelm": "StableLmForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                    "gpt2": "GPT2LMHeadModel", "falcon": "FalconForCausalLM", "mamba": "MambaForCausalLM",
                    "nemotron": "NemotronForCausalLM", "lfm2": "Lfm2ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma normalizes before and after both the attention and the MLP.
_GEMMA_PER_LAYER = {**_PER_LAYER, "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 checkpoints hold q/k/v and gate/up fused, as llama.cpp does.
_PHI3_PER_LAYER = {**_PER_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# StableLM's q/k norms: llama.cpp stacks the per-head LayerNorms into one [heads, head_dim] tensor (split on load).
_STABLELM_PER_LAYER = {**_PER_LAYER, "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"}
# StarCoder2's ungated MLP.
_STARCODER2_PER_LAYER = {**_PER_LAYER, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# GPT-2 keeps the names of its own checkpoints (transformer.h.N.*, which models/gpt2.py maps).
_GPT2_PER_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                   "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Falcon keeps its checkpoints' names too (transformer.h.N.*). One norm feeds both the attention and the MLP, but
# where llama.cpp also has attn_norm_2 (Falcon-40B's ln_attn), attn_norm is the MLP's (ln_mlp).
_FALCON_PER_LAYER = {"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
                     "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h",
                     "ffn_down": "mlp.dense_4h_to_h"}
_FALCON_TWO_NORMS_PER_LAYER = {**_FALCON_PER_LAYER, "attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"}
# Mamba's (backbone.layers.N.*); A_log and D are bare parameters, without .weight (llama.cpp's names have none).
_MAMBA_PER_LAYER = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                    "ssm_x": "mixer.x_proj", "ssm_dt": "mixer.dt_proj", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
                    "ssm_out": "mixer.out_proj"}
_LFM2_PER_LAYER = {**_PER_LAYER, "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
                   "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
                   "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
                   "ffn_up": "feed_forward.w3", "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                   "shortconv.out_proj": "conv.out_proj"}
_GPT_OSS_PER_LAYER = {**_PER_LAYER, "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
                      "attn_sinks": "self_attn.sinks"}
_PER_LAYER_BY_ARCH = {"gemma2": _GEMMA_PER_LAYER, "gemma3": _GEMMA_PER_LAYER, "phi3": _PHI3_PER_LAYER,
                      "stablelm": _STABLELM_PER_LAYER, "starcoder2": _STARCODER2_PER_LAYER, "gpt2": _GPT2_PER_LAYER,
                      "falcon": _FALCON_PER_LAYER, "mamba": _MAMBA_PER_LAYER, "lfm2": _LFM2_PER_LAYER,
                      "gpt-oss": _GPT_OSS_PER_LAYER}
_TOP_LEVEL_BY_ARCH = {"gpt2": {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                               "output_norm": "transformer.ln_f", "output": "lm_head"},
                      "falcon": {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f",
                                 "output": "lm_head"},
                      "mamba": {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f",
                                "output": "lm_head"},
                      # LFM2's final norm is named embedding_norm in its checkpoints (and token_embd_norm by llama.cpp).
                      "lfm2": {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm",
                               "output": "lm_head"}}
_LAYER_PREFIX_BY_ARCH = {"gpt2": "transformer.h", "falcon": "transformer.h", "mamba": "backbone.layers"}
# Parameters whose HF names have no .weight: llama.cpp's ssm_a and ssm_d have none either, its attn_sinks has one.
_BARE_PARAMETERS = ("mixer.A_log", "mixer.D", "self_attn.sinks")
# GPT-2's projections are Conv1D weights, [in, out]; llama.cpp stores them transposed, as a Linear's [out, in].
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Derived from the rope config on the HF side.
_ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# llama.cpp stacks all experts of a layer in one tensor per projection. Like transformers' GGUF
# loader we yield the stacked HF names (no .weight suffix): gate_up_proj [experts, 2 * inter, hidden]
# (gate rows, then up rows), down_proj [experts, hidden, inter]. GPT-OSS's checkpoints hold them transposed, gate and
# up interleaved ([experts, hidden, 2 * inter], gate in the even columns), with biases (gate_up_proj_bias, interleaved
# alike, and down_proj_bias).
_EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}

# The tokenizer's special tokens, by the GGUF metadata key holding each one's id.
_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                   "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


if gguf is not None:
    class _Reader(gguf.GGUFReader):
        # GGUFReader parses metadata with many tiny np.memmap slices, and memmap's per-slice overhead
        # makes a 50k-entry vocabulary take ~2 s; a plain ndarray view of the same mapping is ~3x faster.
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return _Reader(path)


def _reader(path: pathlib.Path) -> gguf.GGUFReader:
    # Config and weights both need the parsed header; the key includes size+mtime so a
    # replaced file is re-read.
    if gguf is None:
        raise ImportError(f"reading the GGUF file {path} needs the gguf package: pip install gguf")
    st = path.stat()
    try:
        return _open_reader(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except Exception as e:  # gguf's parser fails in many ways on a corrupt or truncated file
        raise ValueError(f"cannot read GGUF file {path} (truncated or corrupt?): {type(e).__name__}: {e}") from e


def _field(reader: gguf.GGUFReader, key: str) -> str | int | float | None:
    """A scalar or string metadata value (ReaderField.contents() needs a newer gguf)."""
    f = reader.get_field(key)
    if f is None:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()


def _gguf_file(gguf_path: str | os.PathLike) -> pathlib.Path:
    if not isinstance(gguf_path, (str, os.PathLike)):
        raise TypeError(f"expected a path to a .gguf file, got {type(gguf_path).__name__}")
    p = pathlib.Path(gguf_path)
    if not p.is_file():
        raise ValueError(f"GGUF file not found: {p}")
    return p


def _architecture(reader: gguf.GGUFReader, path: pathlib.Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_ARCHS)}")
    return arch


def resolve_gguf(path: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file `path` designates: the file itself, or the only .gguf in a directory
    without safetensors; None if `path` is not a GGUF checkpoint."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a str or os.PathLike path, got {type(path).__name__}")
    p = pathlib.Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    ggufs = [f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file()]
    return ggufs[0] if len(ggufs) == 1 else None


def load_gguf_config(gguf_path: str | os.PathLike) -> PretrainedConfig:
    """transformers config for a GGUF file, with architectures, tie_word_embeddings,
    head_dim and eos_token_id filled in."""
    p = _gguf_file(gguf_path)
    reader = _reader(p)
    arch = _architecture(reader, p)
    names = {t.name: t for t in reader.tensors}
    config = _gpt_oss_config(reader, names, p) if arch == "gpt-oss" else AutoConfig.from_pretrained(
        p.parent, gguf_file=p.name)
    config.architectures = [_HF_ARCHITECTURE[config.model_type]]
    # No output.weight means llama.cpp dropped a tied lm_head.
    config.tie_word_embeddings = "output.weight" not in names
    # The embedding's rows: transformers takes the vocabulary's length, or a class default when the file has none.
    config.vocab_size = int(_tensor(names, "token_embd.weight", p).shape[1])
    if arch not in ("mamba", "falcon"):  # Mamba has no attention, Falcon's head_dim is a property (hidden / heads)
        config.head_dim = _head_dim(config, names, arch, p)
    if getattr(config, "eos_token_id", None) is None:
        config.eos_token_id = _field(reader, "tokenizer.ggml.eos_token_id")
    if config.eos_token_id is None:
        raise ValueError(f"{p} defines no EOS token (tokenizer.ggml.eos_token_id)")
    if arch in ("qwen2moe", "qwen3moe"):
        _fill_moe_config(config, names, p)
    if arch in ("gemma2", "gemma3"):
        _fill_gemma_config(config, reader, arch, p)
    if arch == "phi3":
        _fill_phi3_config(config, reader, names, p)
    if arch in ("stablelm", "starcoder2"):
        _fill_layernorm_config(config, reader, names, arch)
    if arch == "gpt2":
        _fill_gpt2_config(config, names, p)
    if arch == "falcon":
        _fill_falcon_config(config, reader, names, p)
    if arch == "mamba":
        config.use_bias = "blk.0.ssm_in.bias" in names
        config.use_conv_bias = "blk.0.ssm_conv1d.bias" in names
    if arch == "nemotron":
        _fill_nemotron_config(config, reader, names)
    if arch == "lfm2":  # transformers reads the rest, the layer types from the per-layer KV head counts included
        config.conv_bias = any(n.endswith("shortconv.in_proj.bias") for n in names)
        config.norm_eps = _field(reader, "lfm2.attention.layer_norm_rms_epsilon") or config.norm_eps
    if arch == "llama" and "rope_freqs.weight" in names:
        warnings.warn(f"{p} has rope_freqs (llama3-style RoPE scaling), which is not "
                      "reconstructed into the config; long-context outputs may differ from llama.cpp")
    return config


def _fill_moe_config(config: PretrainedConfig, names: dict[str, gguf.ReaderTensor], path: pathlib.Path) -> None:
    """Expert sizes and the dense layers, which transformers leaves at class defaults: it maps
    neither expert_feed_forward_length nor expert_shared_feed_forward_length, so read them off
    the tensors (GGUF shapes are [in, out, experts])."""
    moe_layers = [i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not moe_layers:
        raise ValueError(f"{path} has no ffn_gate_inp (router) tensor in any layer; is it a MoE checkpoint?")
    first = f"blk.{moe_layers[0]}."
    if first + "ffn_down_exps.weight" not in names:
        raise ValueError(f"{path} has a router but no {first}ffn_down_exps.weight tensor")
    config.moe_intermediate_size = int(names[first + "ffn_down_exps.weight"].shape[0])
    if first + "ffn_down_shexp.weight" in names:
        config.shared_expert_intermediate_size = int(names[first + "ffn_down_shexp.weight"].shape[0])
    # Layers without a router are dense MLPs (Qwen's mlp_only_layers).
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if i not in moe_layers]


# llama.cpp scales Gemma's scores by 1/sqrt(hidden / heads) in the 27B models, which it knows by their layer
# count, and by 1/sqrt(head_dim) in the others: the query_pre_attn_scalar of Google's checkpoints.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _fill_gemma_config(config: PretrainedConfig, reader: gguf.GGUFReader, arch: str, path: pathlib.Path) -> None:
    """What transformers leaves at class defaults: the softcaps the file holds, the score scale llama.cpp
    derives, and Gemma 3's global rope scaling (its local rope base is llama.cpp's fixed 10000)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (value := _field(reader, f"{arch}.{key}")) is not None:
            setattr(config, key, value)
    is_27b = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
    if arch != "gemma3":
        return
    scaling = _field(reader, "gemma3.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"{path}: rope scaling {scaling!r} for gemma3; expected none or linear")
    full = config.rope_parameters["full_attention"]
    if scaling == "linear":
        full.update(rope_type="linear", factor=_field(reader, "gemma3.rope.scaling.factor"))
    if (local_base := _field(reader, "gemma3.rope.freq_base_swa")) is not None:
        config.rope_parameters["sliding_attention"]["rope_theta"] = local_base


def _fill_layernorm_config(config: PretrainedConfig, reader: gguf.GGUFReader, names: dict[str, gguf.ReaderTensor],
                           arch: str) -> None:
    """What transformers leaves at class defaults: the rope base (llama.cpp's default 10000 where the file has
    none), StableLM's rotated share of each head (all of it where the file says nothing, as in llama.cpp) and q/k
    norms, StarCoder2's sliding window (none unless the file holds one)."""
    rope = {"rope_type": "default", "rope_theta": _field(reader, f"{arch}.rope.freq_base") or 10000.0}
    if arch == "stablelm":
        rotary_dim = _field(reader, "stablelm.rope.dimension_count") or config.head_dim
        rope["partial_rotary_factor"] = rotary_dim / config.head_dim
        config.qk_layernorm = "blk.0.attn_q_norm.weight" in names
    else:
        config.sliding_window = _field(reader, "starcoder2.attention.sliding_window") or None
    config.rope_parameters = rope


def _fill_gpt2_config(config: PretrainedConfig, names: dict[str, gguf.ReaderTensor], path: pathlib.Path) -> None:
    """What transformers leaves at class defaults (4 * hidden and 1024): the MLP's width and the position table's
    length, read off the tensors (GGUF shapes are [in, out])."""
    config.n_inner = int(_tensor(names, "blk.0.ffn_up.weight", path).shape[1])
    config.n_positions = int(_tensor(names, "position_embd.weight", path).shape[1])


def _fill_falcon_config(config: PretrainedConfig, reader: gguf.GGUFReader, names: dict[str, gguf.ReaderTensor],
                        path: pathlib.Path) -> None:
    """What transformers leaves at class defaults. llama.cpp's one Falcon graph is the parallel-attention block with
    a KV head count: one KV head and one norm is the 7B layout (multi_query); more KV heads or a second norm (40B's
    attn_norm_2) is the new decoder architecture, which groups each KV head's query heads with it (as the 7B
    layout does for its single KV head). The MLP's width comes off the tensors (llama.cpp writes 4 * hidden), biases
    from their presence."""
    heads, kv_heads = config.num_attention_heads, _field(reader, "falcon.attention.head_count_kv") or 1
    if heads % kv_heads:
        raise ValueError(f"{path}: {heads} attention heads not divisible by {kv_heads} KV heads")
    two_norms = "blk.0.attn_norm_2.weight" in names
    config.new_decoder_architecture = kv_heads != 1 or two_norms
    config.multi_query = not config.new_decoder_architecture
    if config.new_decoder_architecture:
        config.num_kv_heads = kv_heads
        config.num_ln_in_parallel_attn = 2 if two_norms else 1
    config.parallel_attn = True
    config.bias = "blk.0.attn_qkv.bias" in names
    config.ffn_hidden_size = int(_tensor(names, "blk.0.ffn_up.weight", path).shape[1])
    config.layer_norm_epsilon = _field(reader, "falcon.attention.layer_norm_epsilon") or config.layer_norm_epsilon


def _fill_nemotron_config(config: PretrainedConfig, reader: gguf.GGUFReader,
                          names: dict[str, gguf.ReaderTensor]) -> None:
    """What transformers leaves at class defaults: the LayerNorm epsilon (llama.cpp writes a LayerNorm's, transformers
    reads an RMSNorm's), the biases (from their presence) and the rotated share of each head (all of it where the
    file says nothing, as in llama.cpp)."""
    config.norm_eps = _field(reader, "nemotron.attention.layer_norm_epsilon") or config.norm_eps
    config.attention_bias = "blk.0.attn_q.bias" in names
    config.mlp_bias = "blk.0.ffn_up.bias" in names
    rotary_dim = _field(reader, "nemotron.rope.dimension_count") or config.head_dim
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary_dim / config.head_dim}


def _gpt_oss_config(reader: gguf.GGUFReader, names: dict[str, gguf.ReaderTensor],
                    path: pathlib.Path) -> PretrainedConfig:
    """GPT-OSS's config from the metadata: transformers 5.23 fails on its yarn keys (and would leave the head size,
    the window and the experts' width at class defaults). llama.cpp writes the yarn factor and original length; the
    betas are its defaults (and GPT-OSS's), the correction range is not truncated (GPT-OSS's). Even layers are
    sliding, as in llama.cpp."""
    def get(key: str, default: int | float | None = None) -> int | float | None:
        value = _field(reader, f"gpt-oss.{key}")
        if value is None and default is None:
            raise ValueError(f"{path} has no gpt-oss.{key}")
        return default if value is None else value

    rope = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)}
    if (scaling := _field(reader, "gpt-oss.rope.scaling.type")) not in (None, "none", "yarn"):
        raise ValueError(f"{path}: rope scaling {scaling!r} for gpt-oss; expected none or yarn")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=get("rope.scaling.factor"), truncate=False,
                    original_max_position_embeddings=get("rope.scaling.original_context_length"),
                    beta_fast=get("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=get("rope.scaling.yarn_beta_slow", 1.0))
    layers = get("block_count")
    return GptOssConfig(
        num_hidden_layers=layers, hidden_size=get("embedding_length"), max_position_embeddings=get("context_length"),
        num_attention_heads=get("attention.head_count"), num_key_value_heads=get("attention.head_count_kv"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"), sliding_window=get("attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        num_local_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
        intermediate_size=int(_tensor(names, "blk.0.ffn_down_exps.weight", path).shape[0]),
        attention_bias="blk.0.attn_q.bias" in names, rope_parameters=rope,
        **{name: value for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                         ("pad_token_id", "padding_token_id"))
           if (value := _field(reader, f"tokenizer.ggml.{key}")) is not None})


def _tensor(names: dict[str, gguf.ReaderTensor], name: str, path: pathlib.Path) -> gguf.ReaderTensor:
    if name not in names:
        raise ValueError(f"{path} has no {name} tensor; is it a complete checkpoint?")
    return names[name]


def _head_dim(config: PretrainedConfig, names: dict[str, gguf.ReaderTensor], arch: str, path: pathlib.Path) -> int:
    """transformers ignores attention.key_length for qwen and only falls back to a class default
    (128 for qwen3), so read head_dim off the Q projection (or Phi-3's and GPT-2's fused QKV): GGUF shapes are
    [in, out]."""
    # LFM2's first layers may be convolutions: the first attention layer's.
    first = next((i for i in range(config.num_hidden_layers) if f"blk.{i}.attn_q.weight" in names), 0)
    q_name, heads = f"blk.{first}.attn_q.weight", config.num_attention_heads
    if arch in ("phi3", "gpt2"):  # GPT-2's config has no KV head count: as many as query heads
        q_name, heads = "blk.0.attn_qkv.weight", heads + 2 * _kv_heads(config, arch)
    rows = int(_tensor(names, q_name, path).shape[1])
    if rows % heads:
        raise ValueError(f"{path}: {q_name} rows ({rows}) not divisible by its head count {heads}")
    return rows // heads


def _kv_heads(config: PretrainedConfig, arch: str) -> int:
    if arch == "falcon":
        return config.num_kv_heads if config.new_decoder_architecture else 1
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _vector(names: dict[str, gguf.ReaderTensor], name: str, path: pathlib.Path) -> list[float]:
    if name not in names:
        raise ValueError(f"{path} has rope_factors_long.weight but no {name}")
    t = names[name]
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(float).ravel().tolist()


def _fill_phi3_config(config: PretrainedConfig, reader: gguf.GGUFReader, names: dict[str, gguf.ReaderTensor],
                      path: pathlib.Path) -> None:
    """What transformers leaves at class defaults: the sliding window (0: none), the rotated share of each
    head and longrope, whose factors llama.cpp keeps as tensors."""
    config.sliding_window = _field(reader, "phi3.attention.sliding_window") or None
    rope = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    if (rotary_dim := _field(reader, "phi3.rope.dimension_count")) is not None:
        rope["partial_rotary_factor"] = config.partial_rotary_factor = rotary_dim / config.head_dim
    if "rope_factors_long.weight" in names:
        factors = {f"{kind}_factor": _vector(names, f"rope_factors_{kind}.weight", path)
                   for kind in ("short", "long")}
        original = _field(reader, "phi3.rope.scaling.original_context_length")
        rope.update(rope_type="longrope", original_max_position_embeddings=original, **factors)
        config.original_max_position_embeddings = original
    config.rope_parameters = rope


def load_gguf_tokenizer(gguf_path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """transformers fast tokenizer built from the GGUF vocabulary, with its chat template."""
    p = _gguf_file(gguf_path)
    reader = _reader(p)
    # AutoTokenizer reads the model's config first, which transformers 5.23 fails to parse for GPT-OSS (see
    # _gpt_oss_config); the fast tokenizer class reads the vocabulary alone.
    gpt_oss = _field(reader, "general.architecture") == "gpt-oss"
    loader = PreTrainedTokenizerFast if gpt_oss else AutoTokenizer
    try:
        tok = loader.from_pretrained(p.parent, gguf_file=p.name)
    except TypeError as e:  # transformers 5.17 parses the model config to build the tokenizer, and fails on GPT-OSS's
        if not gpt_oss:
            raise
        raise ValueError(f"{p}: transformers {transformers.__version__} cannot build this GPT-OSS file's tokenizer (its "
                         f"GGUF reader fails on the file's rope-scaling keys: {e}); transformers 5.23 can") from e
    # The file's own ids: transformers 5.17 makes SmolLM2's <|im_start|> its EOS token and sets no padding token.
    for name, key in _SPECIAL_TOKENS.items():
        if (token_id := _field(reader, key)) is not None:
            setattr(tok, name, tok.convert_ids_to_tokens(token_id))
    if not getattr(tok, "chat_template", None):
        tok.chat_template = _field(reader, "tokenizer.chat_template")
    return tok


def unpermute_qk(w: ArrayT, n_heads: int) -> ArrayT:
    """Undo llama.cpp's convert-time row permutation of a llama Q or K projection (weight or bias).

    llama.cpp regroups each head's rows from HF's rotate-half layout [first half; second half]
    into interleaved pairs; pass the KV head count for K."""
    d = w.shape[0]
    if n_heads <= 0 or d % (2 * n_heads):
        raise ValueError(f"cannot un-permute {d} rows into {n_heads} heads of even size")
    return w.reshape(n_heads, d // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _per_layer_names(arch: str, config: PretrainedConfig) -> dict[str, str]:
    if arch == "falcon" and config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2:
        return _FALCON_TWO_NORMS_PER_LAYER
    return _PER_LAYER_BY_ARCH.get(arch, _PER_LAYER)


def _hf_name(gguf_name: str, arch: str, per_layer: dict[str, str], path: pathlib.Path) -> str | None:
    base, suffix = gguf_name.rsplit(".", 1) if gguf_name.endswith((".weight", ".bias")) else (gguf_name, "")
    top_level = _TOP_LEVEL_BY_ARCH.get(arch, _TOP_LEVEL)
    if base in top_level and suffix:
        return f"{top_level[base]}.{suffix}"
    blk, layer, part = (base.split(".", 2) + ["", ""])[:3]
    if blk == "blk" and layer.isdigit() and part in per_layer:
        name = f"{_LAYER_PREFIX_BY_ARCH.get(arch, 'model.layers')}.{layer}.{per_layer[part]}"
        if per_layer[part] in _BARE_PARAMETERS:  # without llama.cpp's suffix, if any
            return name
        if suffix:
            return f"{name}.{suffix}"
    # GPT-OSS's experts have biases: HF's {proj}_bias.
    if blk == "blk" and layer.isdigit() and part in _EXPERTS and (suffix == "weight" or arch == "gpt-oss" and suffix):
        return f"model.layers.{layer}.{_EXPERTS[part]}" + ("_bias" if suffix == "bias" else "")
    if base in _ROPE_TENSORS:
        return None
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file {path} (architecture {arch})")


def _dequantize(t: gguf.ReaderTensor, arch: str, name: str, n_heads: int | None, n_kv_heads: int,
                path: pathlib.Path) -> np.ndarray:
    # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
    w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = unpermute_qk(w, n_heads)
    elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = unpermute_qk(w, n_kv_heads)
    elif name.endswith("shared_expert_gate.weight"):
        w = w.reshape(1, -1)  # HF's [1, hidden] Linear; llama.cpp may store it as a vector
    elif arch in ("gemma2", "gemma3", "nemotron") and name.endswith("norm.weight"):
        w = w - 1  # llama.cpp stored 1 + weight, what Gemma's RMSNorm and Nemotron's LayerNorm1P multiply by
    elif arch == "gpt2" and name.endswith(_CONV1D_WEIGHTS):
        w = w.T
    elif arch == "falcon" and name.endswith(("query_key_value.weight", "query_key_value.bias")):
        w = _falcon_qkv(w, n_heads, n_kv_heads, t.name, path)
    elif name.endswith("mixer.A_log"):
        w = np.log(-w)  # llama.cpp stored A = -exp(A_log)
    elif name.endswith(("mixer.conv1d.weight", "conv.conv.weight")):
        w = w[:, None]  # llama.cpp dropped the depthwise conv's 1-channel axis: [channels, 1, kernel]
    elif arch == "gpt-oss" and name.endswith("experts.down_proj"):
        w = w.swapaxes(1, 2)
    return w


def _falcon_qkv(w: np.ndarray, n_heads: int, n_kv_heads: int, gguf_name: str, path: pathlib.Path) -> np.ndarray:
    """Undo llama.cpp's regrouping of Falcon's fused QKV (weight or bias) into all query heads, all key heads, all
    value heads: HF's layout groups each KV head's query heads with it, then its key and value head."""
    if w.shape[0] % (n_heads + 2 * n_kv_heads):
        raise ValueError(f"tensor {gguf_name!r} in {path} has {w.shape[0]} rows, not divisible by {n_heads} query "
                         f"+ 2 x {n_kv_heads} KV heads")
    head_dim, rest = w.shape[0] // (n_heads + 2 * n_kv_heads), w.shape[1:]
    q, k, v = np.split(w, [n_heads * head_dim, (n_heads + n_kv_heads) * head_dim])
    groups = [x.reshape(n_kv_heads, -1, head_dim, *rest) for x in (q, k, v)]
    return np.concatenate(groups, axis=1).reshape(w.shape)


def _join_gate_up(arch: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """One layer's stacked expert gate and up projections (or GPT-OSS's biases) as the HF gate_up_proj."""
    if arch != "gpt-oss":
        return np.concatenate((gate, up), axis=1)
    joined = np.stack((gate, up), axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return joined.swapaxes(1, 2) if joined.ndim == 3 else joined


_STACKED_HEAD_NORMS = ("self_attn.q_layernorm.weight", "self_attn.k_layernorm.weight")  # StableLM's


def _per_head_norms(name: str, w: np.ndarray, heads: int, gguf_name: str, path: pathlib.Path
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """A [heads, head_dim] stack of per-head norm weights as the checkpoint's `{norm}.norms.{h}.weight`."""
    if w.ndim != 2 or w.shape[0] != heads:
        raise ValueError(f"tensor {gguf_name!r} in {path} has shape {list(w.shape)}: expected [{heads}, head_dim], "
                         "one norm per head")
    base = name.removesuffix(".weight")
    for h in range(heads):
        yield f"{base}.norms.{h}.weight", torch.from_numpy(w[h])


def iter_gguf_weights(gguf_path: str | os.PathLike, config: PretrainedConfig
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, dequantized float32 tensor) for every weight in the file."""
    p = _gguf_file(gguf_path)
    reader = _reader(p)
    arch = _architecture(reader, p)
    n_heads = getattr(config, "num_attention_heads", None)
    if not isinstance(n_heads, int) and arch != "mamba":
        raise TypeError(f"config must define num_attention_heads, got {type(config).__name__}")
    n_kv_heads = _kv_heads(config, arch) if arch != "mamba" else 0
    per_layer = _per_layer_names(arch, config)
    gate_or_up: dict[str, tuple[str, np.ndarray]] = {}  # an expert gate_up_proj's first half read
    for t in reader.tensors:
        name = _hf_name(t.name, arch, per_layer, p)
        if name is None:
            continue
        w = _dequantize(t, arch, name, n_heads, n_kv_heads, p)
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            if name not in gate_or_up:
                gate_or_up[name] = (t.name, w)
                continue
            first_name, first = gate_or_up.pop(name)
            w = _join_gate_up(arch, *((first, w) if ".ffn_gate_exps." in first_name else (w, first)))
        # F32 tensors come back as views into the mmap: copy so callers own ordinary memory.
        if np.may_share_memory(w, reader.data) or w.dtype != np.float32 or not w.flags.c_contiguous:
            w = np.array(w, dtype=np.float32, order="C")
        if arch == "stablelm" and name.endswith(_STACKED_HEAD_NORMS):
            yield from _per_head_norms(name, w, n_heads if "q_layernorm" in name else n_kv_heads, t.name, p)
        else:
            yield name, torch.from_numpy(w)
    if gate_or_up:
        first_name = next(iter(gate_or_up.values()))[0]
        raise ValueError(f"{p} has {first_name} but not its ffn_gate_exps/ffn_up_exps partner")
