"""Rotary position embeddings with a precomputed cos/sin table, over the whole head or, with
`partial_rotary_factor`, over its leading dimensions only: the neox layout (dimension i with i + rotary_dim / 2,
most families) or the interleaved one (pairs (x0, x1), (x2, x3), ...: Cohere, GLM)."""
import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cuda import triton_layers
from nanoinfer.layers.layernorm import RMSNorm


def rope_layer_type(config: PretrainedConfig, layer_type: str | None = None) -> str | None:
    """The key of the config's rope settings for `layer_type` (default: the first layer's) when transformers nests
    them by layer type (Gemma 3: "sliding_attention" / "full_attention"), or by a rope label of their own that
    layer_type names (DeepSeek-V4: "main" / "compress"); None when they are flat."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        return layer_type
    nested = [t for t in (getattr(config, "layer_types", None) or ()) if t in params]
    return (layer_type or nested[0]) if nested else None


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The rope settings of transformers 5 (`rope_parameters`, those of `layer_type` where nested) or 4
    (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    if (nested_type := rope_layer_type(config, layer_type)) is not None:
        params = dict(params[nested_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inv_frequencies(config: PretrainedConfig, rotary_dim: int, layer_type: str | None = None
                    ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor of the config's rope type (transformers' own
    functions for the non-default types read the head size and partial_rotary_factor from the config)."""
    params = rope_parameters(config, layer_type)
    rope_type, theta = params["rope_type"], params["rope_theta"]
    if rope_type == "dynamic" and params.get("alpha"):
        # HunYuan's NTK alpha: labelled "dynamic", but a fixed alpha only stretches the base, whatever the length.
        rope_type, theta = "default", theta * params["alpha"] ** (rotary_dim / (rotary_dim - 2))
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (theta ** exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError(f"rope_type {rope_type!r} depends on the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    nested_type = rope_layer_type(config, layer_type)
    kwargs = {} if nested_type is None else {"layer_type": nested_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def with_rope_parameters(config: PretrainedConfig, **updates) -> PretrainedConfig:
    """A shallow copy of config whose rope settings are its own with `updates`: GraniteSWA's base for the layer (as
    transformers builds one rotary embedding per layer base), Molmo 2's default rope type for its unscaled layers."""
    config = copy.copy(config)
    config.rope_parameters = {**rope_parameters(config), **updates}
    return config


def longrope_frequencies(config: PretrainedConfig, max_position: int) -> tuple[torch.Tensor, float]:
    """Per-position inverse frequencies [max_position, rotary_dim / 2] of longrope (Phi-3, Phi-4-mini), and its
    attention scaling. transformers rotates a forward pass with the long factors when its sequence reaches
    beyond `original_max_position_embeddings`, else with the short ones; here each position takes the factors of
    a sequence ending there. The same whenever a prompt fits in that length (a decode step past it included);
    a longer prompt transformers rotates all with the long factors, here its first positions keep the short."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    original = rope_parameters(config)["original_max_position_embeddings"]
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=original + 1)
    beyond = torch.arange(max_position) >= original
    return torch.where(beyond[:, None], long.float(), short.float()), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, scaling: float | torch.Tensor = 1.0,
                 interleaved: bool = False, fp64: bool = False, in_dtype: bool = False):
        """inv_freq: [rotary_dim / 2], or one row per position [max_position, rotary_dim / 2]; scaling: one factor,
        or one per position [max_position, 1] (PhiMoE's). interleaved: pair i rotates dimensions (2i, 2i + 1)
        instead of (i, i + rotary_dim / 2). fp64: the angles, their cosines and sines in fp64 before the table's
        fp32 (Ergo's, exact at long-context positions, where fp32 angles drift). in_dtype: in 16-bit models, the
        cosines, sines, each product and each sum rounded to the activations' dtype, as transformers' Llama rotates
        (x * cos + rotate_half(x) * sin with cos and sin cast to x's dtype); else rotated in fp32, rounded once."""
        super().__init__()
        angle_dtype = torch.float64 if fp64 else torch.float32
        inv_freq = inv_freq.to(torch.get_default_device(), angle_dtype)  # the table is built where the model is
        if isinstance(scaling, torch.Tensor):
            scaling = scaling.to(inv_freq.device)
        freqs = torch.arange(max_position, dtype=angle_dtype, device=inv_freq.device).unsqueeze(1) * inv_freq
        # Non-persistent: derived from the config, never in a checkpoint.
        self.register_buffer("cos", (freqs.cos() * scaling).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).float(), persistent=False)
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.shape[-1]  # the leading dims that rotate; the rest pass through
        self.interleaved = interleaved
        self.in_dtype = in_dtype

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] -> rotated copies; per-head RMSNorms
        (Qwen3's q/k norm), if given, are applied first, in the same pass on the CPU path and on CUDA."""
        return self.rotate(positions, q, q_norm), self.rotate(positions, k, k_norm)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, norm: RMSNorm | None = None, inverse: bool = False
               ) -> torch.Tensor:
        """One of forward's tensors (alone: Gemma 4's layers that reuse another layer's keys rotate their queries);
        inverse: turned back by the positions' angles (DeepSeek-V4 unrotates its attention output)."""
        if inverse:
            return self._rotate(x, self.cos[positions].unsqueeze(1), -self.sin[positions].unsqueeze(1))
        if norm is not None and norm.weight.dtype != x.dtype:
            # Gemma's fp32 (1 + weight) on 16-bit activations rounds its own way, not as the fused kernels do.
            x, norm = norm(x), None
        # The C and Triton kernels rotate the neox layout only: the interleaved one (Cohere, GLM) takes the torch
        # ops below on every device, ~10 small ops per tensor where the kernels take one.
        if not self.interleaved and cpu_kernels.use_cpu_kernels(x):
            return cpu_kernels.rotary_neox(x, positions, self.cos, self.sin, *_norm_args(norm))
        if not self.interleaved and x.is_cuda and (kernels := triton_layers()) is not None:  # 1 kernel, not ~10
            return kernels.rotary_neox(x, positions, self.cos, self.sin, *_norm_args(norm), in_dtype=self.in_dtype)
        if norm is not None:
            x = norm(x)
        return self._rotate(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.in_dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        else:
            x = x.float()
        if self.interleaved:
            x1, x2 = x[..., 0:self.rotary_dim:2], x[..., 1:self.rotary_dim:2]
            parts = (torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2),)
        else:
            x1, x2 = x[..., :self.rotary_dim].chunk(2, -1)
            parts = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if self.rotary_dim < self.head_dim:
            parts += (x[..., self.rotary_dim:],)
        return torch.cat(parts, -1).to(dtype)


def _norm_args(norm: RMSNorm | None) -> tuple:
    return () if norm is None else (norm.weight, norm.eps)


_shared: dict[tuple, RotaryEmbedding] | None = None  # the tables of the model being built in shared_rope_tables


@contextmanager
def shared_rope_tables() -> Iterator[None]:
    """Layers built inside share one RotaryEmbedding per distinct table (a model has one, or one per layer type)
    instead of a copy each: Qwen3-0.6B's 28 layers x 40,960 positions would take 28 x 21 MB of the GPU."""
    global _shared
    previous, _shared = _shared, {}
    try:
        yield
    finally:
        _shared = previous


def get_rope(config: PretrainedConfig, head_dim: int, max_position: int, layer_type: str | None = None,
             interleaved: bool = False, rotary_dim: int | None = None, theta: float | None = None,
             reverse: bool = False, fp64: bool = False, scaled: bool = True, in_dtype: bool = False) -> RotaryEmbedding:
    """The rotary embedding of the config's rope settings (for `layer_type`, where they differ by layer type), in the
    interleaved layout where asked (see RotaryEmbedding), over rotary_dim leading dims where given (else the
    settings' partial_rotary_factor of the head), with base theta where given (else the settings'); reverse: every
    angle negated (NanoChat's rotate_half, (x2, -x1), turns the other way), i.e. the sine tables'; fp64: its
    angles in fp64 (see RotaryEmbedding); scaled False: the settings' base without their scaling (rope_type);
    in_dtype: rounded as transformers' Llama rounds (see RotaryEmbedding)."""
    if theta is not None:
        config = with_rope_parameters(config, rope_theta=theta)
    if not scaled:
        config = with_rope_parameters(config, rope_type="default")
    params = rope_parameters(config, layer_type)
    rotary_dim = rotary_dim or int(head_dim * params.get("partial_rotary_factor", 1.0))
    device = torch.get_default_device()
    with torch.device("cpu"):  # the model may be built under another device; transformers' functions need data
        if params["rope_type"] == "longrope":
            inv_freq, scaling = longrope_frequencies(config, max_position)
        else:
            inv_freq, scaling = inv_frequencies(config, rotary_dim, layer_type)
    if reverse:
        inv_freq = -inv_freq
    if _shared is None:
        return RotaryEmbedding(head_dim, max_position, inv_freq, scaling, interleaved, fp64, in_dtype)
    key = (head_dim, max_position, tuple(inv_freq.shape), inv_freq.numpy().tobytes(), scaling, interleaved, fp64,
           in_dtype, device)
    if key not in _shared:
        _shared[key] = RotaryEmbedding(head_dim, max_position, inv_freq, scaling, interleaved, fp64, in_dtype)
    return _shared[key]
