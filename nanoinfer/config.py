"""Engine settings given to `LLM(...)`, checked against the model's own config."""
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from nanoinfer.layers.attention.selector import (DEFAULT_BLOCK_SIZE, check_backend_limits,
                                                  check_tensor_parallel_devices, resolve_device, select_backend)
from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.layers.sampler import LOGPROBS_MODES
from nanoinfer.logits_processor import load_logits_processor
from nanoinfer.models.registry import (cache_head_size, chunked_attention_size, has_attention_sinks, is_classifier,
                                       is_encoder, is_vision_language, pytorch_only_attention)
from nanoinfer.models.vision_language import LANGUAGE_MODEL_NAMES, MEDIA_TOKEN_IDS
from nanoinfer.sampling_params import SamplingParams, check_seed
from nanoinfer.spec_decode.config import SpeculativeConfig, parse_speculative_config
from nanoinfer.utils.gguf_loader import load_gguf_config, resolve_gguf
from nanoinfer.utils.loader import iter_safetensors
from nanoinfer.utils.quantization import check_quantization

# generation-config fields that become SamplingParams defaults (vLLM's list), and their SamplingParams names.
GENERATION_SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a folder holding either has a tokenizer
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class Config:
    model: str | os.PathLike
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kvcache_block_size: int | None = None  # 16 (cpu, triton), 256 for flash (flash-attn's paged KV rule)
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    device: str | torch.device = "auto"  # CUDA when visible, else CPU
    attention_backend: str = "auto"  # CUDA: "flash" with flash-attn, else "triton"; CPU: "cpu" (PyTorch)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode
    # Schedule each step while the previous one runs on the device, its sampled tokens fed there (vLLM's option).
    async_scheduling: bool = False
    # vLLM's: "fcfs", requests in arrival order; "priority", by each request's priority (lower first), then arrival.
    scheduling_policy: str = "fcfs"
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU's memory the engine may use, KV cache included
    enable_lora: bool = False  # requests may name a LoRA adapter (see nanoinfer/lora)
    max_loras: int = 1  # adapters held at once (slots); a step runs tokens of at most this many
    max_lora_rank: int = 16  # the largest adapter rank r the slots hold
    # vLLM's {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}
    speculative_config: dict | None = None
    # Where generate() without sampling_params takes its defaults (vLLM's option): "auto", the model folder's
    # generation_config.json; "vllm", none (SamplingParams()); else a folder holding one.
    generation_config: str | os.PathLike = "auto"
    override_generation_config: dict | None = None  # generation-config fields over the file's, e.g. {"temperature": 0.5}
    tokenizer: str | os.PathLike | None = None  # a folder holding the tokenizer to use instead of the model's
    # Let transformers run the Python a model (or tokenizer) folder ships for its config and tokenizer classes
    # (vLLM's flag); the model itself always runs nanoinfer's own code for its architecture.
    trust_remote_code: bool = False
    # vLLM's: LogitsProcessor subclasses, or their "module:Class" names (see nanoinfer/logits_processor.py).
    logits_processors: list | None = None
    # vLLM's: what sampled tokens' logprobs report, raw or processed (see LOGPROBS_MODES in layers/sampler.py).
    logprobs_mode: str = "raw_logprobs"
    # vLLM's: fields set on the model's config as it is read (a dict for a sub-config updates it), or a function of
    # the config returning the one to use.
    hf_overrides: dict | Callable[[PretrainedConfig], PretrainedConfig] | None = None
    # vLLM's: prompts may be given as embeddings, {"prompt_embeds": [tokens, hidden] tensor}.
    enable_prompt_embeds: bool = False
    hf_config: PretrainedConfig = field(init=False, repr=False)
    gguf_path: Path | None = field(init=False, default=None)
    eos_token_ids: list[int] = field(init=False, default_factory=list)
    speculative: SpeculativeConfig | None = field(init=False, default=None)  # speculative_config, checked
    default_sampling: dict = field(init=False, default_factory=dict)  # SamplingParams fields (see _default_sampling)
    logits_processor_classes: tuple = field(init=False, default=())  # logits_processors, imported

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path (str or os.PathLike), got {self.model!r}")
        path = Path(os.fspath(self.model)).expanduser()
        if not path.exists():
            raise ValueError(f"model path {str(path)!r} does not exist")
        self.model_path = path
        if not isinstance(self.trust_remote_code, bool):
            raise TypeError(f"trust_remote_code must be a bool, got {self.trust_remote_code!r}")
        self.tokenizer_path = self._tokenizer_path()
        self.gguf_path = resolve_gguf(path)
        if self.gguf_path is not None:
            self.hf_config = load_gguf_config(self.gguf_path)
        elif (path / "config.json").is_file():
            try:
                self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
            except Exception as e:  # transformers' own checks: bad JSON, a field of the wrong type, ...
                raise ValueError(f"cannot read the model config {path / 'config.json'}: {e}") from e
        else:
            raise ValueError(f"{str(path)!r} holds neither a config.json nor a .gguf file")
        if self.hf_overrides is not None:
            self.hf_config = overridden(self.hf_config, self.hf_overrides)
        if self.gguf_path is None and is_vision_language(self.hf_config.architectures):
            self.hf_config = language_model_config(self.hf_config, path)
        self._check_model_config(self.gguf_path or path / "config.json")
        self.torch_device = resolve_device(self.device)
        # DeepSeek's MLA caches its latent (kv_lora_rank) and rope key as one head, the latent doubling as the values;
        # the widest layer's (dots3 note's sliding layers have their own).
        latent_dim = max(getattr(layer, "kv_lora_rank", None) or 0 for layer in layer_configs(self.hf_config)) or None
        head_dim = cache_head_dim(self.hf_config, latent_dim)
        self.attention_backend = select_backend(self.attention_backend, self.torch_device,
                                                latent_cache=latent_dim is not None,
                                                attention_sinks=has_attention_sinks(self.hf_config.architectures),
                                                chunked_attention=chunked_attention_size(self.hf_config) is not None,
                                                pytorch_only=pytorch_only_attention(self.hf_config.architectures),
                                                head_dim=head_dim or 0)
        self.torch_dtype = self._resolve_dtype()
        if self.kvcache_block_size is None:
            self.kvcache_block_size = DEFAULT_BLOCK_SIZE[self.attention_backend]
        limit = position_limit(self.hf_config)
        if self.max_model_len is None:
            self.max_model_len = 4096 if limit is None else min(limit, 4096)
        _positive("max_model_len", self.max_model_len)
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the {limit} positions of the model's "
                             f"config ({position_field(self.hf_config)} in {self.model_path})")
        if not hasattr(self.hf_config, position_field(self.hf_config)):
            # No position limit, but rope tables to build (RecurrentGemma's windowed attention turns by absolute
            # position): they cover the longest sequence the engine runs.
            setattr(self.hf_config, position_field(self.hf_config), self.max_model_len)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size"):
            _positive(name, getattr(self, name))
        if head_dim is not None:
            check_backend_limits(self.attention_backend, self.kvcache_block_size, self.torch_dtype, head_dim,
                                 latent_dim)
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
            raise TypeError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        check_seed("seed", self.seed)
        for name in ("enable_lora", "enable_prompt_embeds"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.num_kvcache_blocks is not None:
            _positive("num_kvcache_blocks", self.num_kvcache_blocks)
            if self.num_kvcache_blocks * self.kvcache_block_size < self.max_model_len:
                raise ValueError(
                    f"num_kvcache_blocks={self.num_kvcache_blocks} x kvcache_block_size={self.kvcache_block_size} "
                    f"cannot hold one sequence of max_model_len={self.max_model_len}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        check_tensor_parallel_devices(self.device, self.torch_device, self.tensor_parallel_size)
        self._check_shardable()
        self.speculative = parse_speculative_config(self.speculative_config)
        self._check_async_scheduling()
        self.logits_processor_classes = self._logits_processor_classes()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        # The model folder's generation config, read once: its EOS ids (not a GGUF model's, whose file holds its
        # own) and its sampling fields.
        generation = _read_generation_config(self.model_path) if self.model_path.is_dir() else None
        self.eos_token_ids = self._eos_token_ids(None if self.gguf_path is not None else generation)
        self.default_sampling = self._default_sampling(generation)

    def _check_async_scheduling(self) -> None:
        """A step scheduled ahead takes its decode ids from the tokens sampled on the device, and drafts are verified
        on the host."""
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling=True cannot be combined with speculative_config="
                             f"{self.speculative_config!r}")

    def _logits_processor_classes(self) -> tuple:
        """logits_processors, imported; refused, as vLLM refuses them, with drafts (verified without them) and for a
        model that only pools."""
        if self.logits_processors is None:
            return ()
        if isinstance(self.logits_processors, str) or not isinstance(self.logits_processors, list | tuple):
            raise TypeError(f"logits_processors must be a list of LogitsProcessor classes or 'module:Class' names, "
                            f"got {self.logits_processors!r}")
        classes = tuple(load_logits_processor(spec) for spec in self.logits_processors)
        if classes and self.speculative is not None:
            raise ValueError(f"custom logits_processors cannot be combined with speculative_config="
                             f"{self.speculative_config!r}")
        architectures = self.hf_config.architectures
        if classes and (is_encoder(architectures) or is_classifier(architectures)):
            raise ValueError(f"{self.model_path} only pools ({architectures[0]}): it takes no logits_processors")
        return classes

    def _tokenizer_path(self) -> Path | None:
        """The `tokenizer` folder, checked; None: the model's own (from its folder or GGUF file)."""
        if self.tokenizer is None:
            return None
        if not isinstance(self.tokenizer, (str, os.PathLike)):
            raise TypeError(f"tokenizer must be a folder path (str or os.PathLike), got {self.tokenizer!r}")
        path = Path(os.fspath(self.tokenizer)).expanduser()
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"tokenizer={str(path)!r} holds none of {', '.join(TOKENIZER_FILES)}")
        return path

    def _check_model_config(self, source: Path) -> None:
        """The model's own sizes and constants, where a bad value would otherwise fail obscurely (or not at all)."""
        cfg = self.hf_config
        # Dequantized on load (FP8, MXFP4, GPTQ, AWQ, compressed-tensors); other methods' files hold weights no layer
        # here reads: refused before any is loaded.
        check_quantization(cfg, source)
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings", "num_key_value_heads", "head_dim", "attention_chunk_size")
        for layer, name in itertools.product(layer_configs(cfg), sizes):
            value = getattr(layer, name, None)
            # Gemma 3n's intermediate_size: a list, one per layer.
            values = value if name == "intermediate_size" and isinstance(value, list) and value else [value]
            if value is not None and any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name}={value!r} in {source} must be a positive int")
        for name, value in (("rope_theta", rope_parameters(cfg)["rope_theta"]),
                            ("rms_norm_eps", getattr(cfg, "rms_norm_eps", None))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name}={value!r} in {source} must be a finite number > 0")

    def _check_shardable(self) -> None:
        """Each rank holds whole heads and an equal share of the MLP; fewer KV heads than ranks are replicated."""
        tp, cfg = self.tensor_parallel_size, self.hf_config
        # Attention-free models (Mamba): no heads to split. dots3 note's differ by layer.
        heads = [getattr(layer, "num_attention_heads", None) or tp for layer in layer_configs(cfg)]
        # GPT-2's config names the MLP's width n_inner (None: 4 x hidden), OPT's ffn_dim.
        mlp_size = (getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
                    or getattr(cfg, "ffn_dim", None) or 4 * cfg.hidden_size)
        mlp_sizes = mlp_size if isinstance(mlp_size, list) else [mlp_size]  # Gemma 3n's: one per layer
        per_layer_heads = getattr(cfg, "num_attention_heads_per_layer", None) or ()  # Laguna's
        for name, value in (*(("num_attention_heads", h) for h in heads),
                            *(("intermediate_size", size) for size in mlp_sizes),
                            *((f"num_attention_heads_per_layer[{i}]", h) for i, h in enumerate(per_layer_heads))):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({value})")
        for layer, layer_heads in zip(layer_configs(cfg), heads):
            kv_heads = getattr(layer, "num_key_value_heads", None) or layer_heads
            if kv_heads % tp and tp % kv_heads:
                raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads ({kv_heads}): "
                                 "one must divide the other")

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return self._gpu_dtype()
            # On the CPU bf16/fp16 matmuls are several times slower than fp32 without AMX.
            return torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
        return _DTYPES[self.dtype]

    def _gpu_dtype(self) -> torch.dtype:
        """The checkpoint's dtype when it is 16-bit, else bfloat16 (float16 on GPUs without bf16)."""
        saved = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        saved = _DTYPES.get(saved, saved) if isinstance(saved, str) else saved
        if saved in (torch.float16, torch.bfloat16):
            return saved
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def _eos_token_ids(self, generation: GenerationConfig | None) -> list[int]:
        eos = None if generation is None else generation.eos_token_id
        if eos is None:  # a config may not have the field at all (Molmo 2's text config)
            eos = getattr(self.hf_config, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def _default_sampling(self, model_generation: GenerationConfig | None) -> dict:
        """The SamplingParams fields that generate() without sampling_params takes, as vLLM takes them: the generation
        config's (the model's, for generation_config="auto") temperature, top_k, top_p, min_p, repetition_penalty and
        max_new_tokens (as max_tokens), with override_generation_config over them."""
        source, override = self.generation_config, self.override_generation_config
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
        if override is not None and not isinstance(override, dict):
            raise TypeError(f"override_generation_config must be a dict, got {override!r}")
        if source == "auto":
            folder, generation = self.model_path, model_generation
        elif source == "vllm":
            folder, generation = None, None
        else:
            folder = Path(os.fspath(source)).expanduser()
            if (generation := _read_generation_config(folder)) is None:
                raise ValueError(f"generation_config={str(source)!r}: no generation_config.json there")
        values, origin = {}, "override_generation_config"
        if generation is not None:
            values = generation.to_diff_dict()
            origin = f"{folder / 'generation_config.json'}" + (" and override_generation_config" if override else "")
        values.update(override or {})
        sampling = {name: values[k] for k, name in GENERATION_SAMPLING_FIELDS.items() if values.get(k) is not None}
        try:
            SamplingParams(**sampling)
        except (TypeError, ValueError) as e:
            raise type(e)(f"sampling defaults from {origin}: {e}") from e
        return sampling

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}


def _read_generation_config(folder: Path) -> GenerationConfig | None:
    """folder's generation_config.json as transformers reads it; None where there is none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(folder)
    except Exception as e:  # transformers' own checks: bad JSON, contradictory fields, ...
        raise ValueError(f"cannot read the generation config {path}: {e}") from e


def layer_configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """Each layer's config where transformers' differs by layer (Gemma 4's full layers have their own head size and
    KV heads, and reading those from the config itself is an error), else the config alone."""
    if not getattr(config, "is_heterogeneous", False):
        return [config]
    return [config.per_layer_config[i] for i in range(config.num_hidden_layers)]


def hidden_states_width(config: PretrainedConfig) -> int:
    """The width of the hidden states a model returns, which its LM head (or classifier's score) takes: OPT-350m's
    are projected out to `word_embed_proj_dim`."""
    return getattr(config, "word_embed_proj_dim", None) or config.hidden_size


def cache_head_dim(config: PretrainedConfig, latent_dim: int | None) -> int | None:
    """The KV cache's head size, the widest layer's (DiffLlama's cache holds heads twice as wide as its model's, Doge's
    8 wider); MLA's latent plus its rope key; None for attention-free models (Mamba)."""
    if getattr(layer_configs(config)[0], "num_attention_heads", None) is None:
        return None
    if latent_dim is not None:  # head_dim is the rope part there
        return latent_dim + config.qk_rope_head_dim
    widest = max(getattr(layer, "head_dim", None) or config.hidden_size // layer.num_attention_heads
                 for layer in layer_configs(config))
    return cache_head_size(config.architectures, widest)


def overridden(config: PretrainedConfig, overrides: object, name: str = "hf_overrides") -> PretrainedConfig:
    """config with vLLM's hf_overrides: a dict's fields set on it (a dict given for a sub-config, such as
    text_config, updates that), or what a function of it returns."""
    if callable(overrides):
        config = overrides(config)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"{name} must return the model's config (a PretrainedConfig), got {config!r}")
        return config
    if not isinstance(overrides, dict):
        raise TypeError(f"{name} must be a dict of config fields or a function of the config, got {overrides!r}")
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be config field names (strings), got {key!r}")
        if isinstance(value, dict) and isinstance(getattr(config, key, None), PretrainedConfig):
            overridden(getattr(config, key), value, f"{name}[{key!r}]")
        else:
            setattr(config, key, value)
    return config


def language_model_config(config: PretrainedConfig, model_dir: Path) -> PretrainedConfig:
    """A vision-language checkpoint's text_config, which its language model runs on alone (models/vision_language.py),
    with the checkpoint's architectures and the settings transformers reads from the outer config."""
    text = getattr(config, "text_config", config)  # (GIT's config is flat: no text_config)
    text.architectures = config.architectures
    # transformers 5 ties the LM head as the outer config says (Qwen2-VL's text config has no such field; Mistral 3's
    # outer one defaults to True; Mllama's has none: untied), but not where the checkpoint holds a head of its own
    # (under any of the wrappers' names for it: Ovis2.5's `llm.lm_head`, the Qwen Omni thinkers' `thinker.lm_head`,
    # GIT's `output`).
    heads = {"lm_head.weight", "output.weight"} | {old[1:] + "weight" for old, new in LANGUAGE_MODEL_NAMES.items()
                                                   if new == "lm_head."}
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False) and not any(
        name in heads for name, _ in iter_safetensors(model_dir))
    for name in ("dtype", "quantization_config", "eos_token_id", *MEDIA_TOKEN_IDS):  # where the outer config has them
        if getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    # Gemma 3n's wrapper embeds the ids from a media sub-config's `vocab_offset` on with tables of its own.
    text.media_token_configs = {name: sub for name in ("vision_config", "audio_config")
                                if hasattr(sub := getattr(config, name, None), "vocab_offset")}
    return text


def position_field(config: PretrainedConfig) -> str:
    """The config field that bounds a sequence: MPT's `max_seq_len` (its ALiBi table's length in transformers),
    Whisper's `max_target_positions` (its decoder's), else max_position_embeddings."""
    return {"mpt": "max_seq_len", "whisper": "max_target_positions"}.get(config.model_type, "max_position_embeddings")


# The model types whose positions count from pad_token_id + 1 (RoBERTa's layout: bert.py, bert_decoder.py).
ROBERTA_POSITIONS = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "roberta-prelayernorm", "xlm-roberta-xl",
                     "xmod")


def position_limit(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's positions cover: position_field's value (None: no positions, as Mamba's or
    BLOOM's, no limit), less the first pad_token_id + 1 rows that RoBERTa's positions skip (ROBERTA_POSITIONS). RWKV's
    context_length (its max_position_embeddings) bounds a single pass of transformers' CUDA kernel, not a sequence."""
    if config.model_type == "rwkv":
        return None
    limit = getattr(config, position_field(config), None)
    if limit is not None and config.model_type in ROBERTA_POSITIONS:
        limit -= (config.pad_token_id or 0) + 1
    return limit


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
