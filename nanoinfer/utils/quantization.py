"""Quantized checkpoints (block-wise FP8, GPT-OSS's MXFP4) dequantized to the model's dtype as their tensors are
read, as transformers does with `dequantize=True`: the layers only ever see ordinary weights."""
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from nanoinfer.utils.loader import LazyTensor

# quant_method values with a dequantizer here, and the architectures each one serves (None: any).
SUPPORTED_METHODS: dict[str, tuple[str, ...] | None] = {"fp8": None, "mxfp4": ("GptOssForCausalLM",)}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# MXFP4's e2m1 code points, indexed by the 4-bit code (sign bit highest).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E8M0_BIAS = 127  # an e8m0 scale byte b means 2 ** (b - 127)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint pairs each quantized tensor with its scale, and how the two become one weight."""
    data_suffix: str  # the quantized tensor's name ends so ...
    scale_suffix: str  # ... and its scale's: the same name with this suffix instead
    is_quantized: Callable[[torch.Tensor | LazyTensor], bool]  # a data-suffixed tensor stored unquantized passes
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    weight_suffix: str  # the dequantized tensor's name ends so (in place of data_suffix)


def check_quantization(hf_config: PretrainedConfig, source: Path) -> None:
    """A `quantization_config` this engine dequantizes on load, or a ValueError naming what it is and where."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if method not in SUPPORTED_METHODS or architecture not in (SUPPORTED_METHODS[method] or (architecture,)):
        supported = ", ".join(f"{m!r}" + (f" ({', '.join(a)})" if a else "") for m, a in SUPPORTED_METHODS.items())
        raise ValueError(f"quantization_config (quant_method={method!r}) in {source}: not supported for "
                         f"{architecture}; the quantized checkpoints that load (dequantized) are {supported}. Use an "
                         "unquantized (bf16/fp16/fp32) checkpoint or a GGUF file")
    if method == "fp8":
        _check_fp8(quantization, source)


def _check_fp8(quantization: dict, source: Path) -> None:
    activation_scheme = quantization.get("activation_scheme", "dynamic")
    if activation_scheme != "dynamic":  # static scales would quantize activations, which dequantizing drops
        raise ValueError(f"quantization_config activation_scheme={activation_scheme!r} in {source}: only 'dynamic' "
                         "FP8 checkpoints are supported")
    block = quantization.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2 or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise ValueError(f"quantization_config weight_block_size={block!r} in {source}: expected two positive ints")
    if quantization.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(f"quantization_config expert_dtype={quantization['expert_dtype']!r} in {source}: only "
                         "FP8 experts are supported")


def quant_scheme(hf_config: PretrainedConfig) -> QuantScheme | None:
    """The scheme of a checkpoint that check_quantization accepted; None when it is not quantized."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    if quantization["quant_method"] == "mxfp4":
        return QuantScheme("_blocks", "_scales", lambda t: True, dequantize_mxfp4, "")
    block = quantization.get("weight_block_size")

    def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(weight, scale_inv, None if block is None else tuple(block), dtype)
    return QuantScheme(".weight", ".weight_scale_inv", _stored_as_fp8, dequantize, ".weight")


def _stored_as_fp8(tensor: torch.Tensor | LazyTensor) -> bool:
    if isinstance(tensor, LazyTensor):
        return tensor.stored_dtype.startswith("F8_")
    return tensor.dtype in _FP8_DTYPES


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """weight x scale_inv in fp32, each scale covering its [block] tile of the last two dims (the edge tiles cut
    short, as DeepSeek's and vLLM's kernels read them), or the whole tensor without blocks; then cast to dtype."""
    scale = _scale_values(scale_inv)
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"per-tensor FP8 scale has shape {list(scale.shape)}: expected one value")
        return (weight.float() * scale.reshape(())).to(dtype)
    if weight.dim() < 2:
        raise ValueError(f"FP8 weight has shape {list(weight.shape)}: block scales need a matrix")
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 scale has shape {list(scale.shape)}, weight {list(weight.shape)}: expected "
                         f"{list(expected)} for weight_block_size {list(block)}")
    scale = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from their stored form: floats, or e8m0 exponent bytes (the `ue8m0` scale format)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - _E8M0_BIAS)
    return scale.float()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """GPT-OSS experts from MXFP4: blocks [experts, rows, groups, 16] (two e2m1 codes a byte, low nibble first),
    scales [experts, rows, groups] (one e8m0 exponent per 32 values) -> [experts, columns, rows] in dtype,
    transposed as transformers lays out GPT-OSS's expert weights ([in, out])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales {scales.dtype} "
                         f"{list(scales.shape)}: expected uint8 [experts, rows, groups, bytes] and [experts, rows, "
                         "groups]")
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * 2 * width, rows, dtype=dtype, device=blocks.device)
    for e in range(experts):  # one expert's temporaries at a time: codes and values of all would take GBs
        out[e] = _mxfp4_matrix(blocks[e], scales[e]).T
    return out


def _mxfp4_matrix(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, groups, bytes] codes and [rows, groups] exponents -> [rows, groups * 2 * bytes] fp32."""
    values = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).int()  # [rows, groups, bytes, 2]: low nibble first
    exponents = (scales.int() - _E8M0_BIAS).repeat_interleave(2 * blocks.shape[-1], dim=-1)
    return torch.ldexp(values[codes].flatten(-3), exponents)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor | LazyTensor]], scheme: QuantScheme,
                        device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """The checkpoint's tensors with each quantized one and its scale (in either order, in any of the files)
    replaced by the weight they make, dequantized on `device` to `dtype`; every other tensor passes as it is."""
    pending: dict[str, dict[str, tuple[torch.Tensor, Path | None]]] = {"data": {}, "scale": {}}
    for name, tensor in weights:
        if name.endswith(scheme.scale_suffix):
            kind, base = "scale", name.removesuffix(scheme.scale_suffix)
        elif name.endswith(scheme.data_suffix) and scheme.is_quantized(tensor):
            kind, base = "data", name.removesuffix(scheme.data_suffix)
        else:
            yield name, tensor
            continue
        # Held on the host until its partner arrives (usually the next tensor, in the same file).
        pending[kind][base] = (tensor[...] if isinstance(tensor, LazyTensor) else tensor, getattr(tensor, "file", None))
        if base in pending["data"] and base in pending["scale"]:
            yield base + scheme.weight_suffix, _dequantize(scheme, base, pending, device, dtype)
    if pending["data"]:
        base, (_, file) = next(iter(pending["data"].items()))
        raise ValueError(f"quantized checkpoint tensor {base + scheme.data_suffix!r}{_in(file)} has no scale "
                         f"{base + scheme.scale_suffix!r} in the checkpoint")
    if pending["scale"]:
        base, (_, file) = next(iter(pending["scale"].items()))
        raise ValueError(f"checkpoint tensor {base + scheme.scale_suffix!r}{_in(file)} scales no quantized "
                         f"tensor: {base + scheme.data_suffix!r} is missing or not quantized")


def _dequantize(scheme: QuantScheme, base: str, pending: dict[str, dict[str, tuple[torch.Tensor, Path | None]]],
                device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    (data, file), (scale, _) = pending["data"].pop(base), pending["scale"].pop(base)
    try:
        return scheme.dequantize(data.to(device), scale.to(device), dtype)
    except ValueError as e:
        raise ValueError(f"cannot dequantize checkpoint tensor {base + scheme.data_suffix!r}{_in(file)}: {e}") from None


def _in(file: Path | None) -> str:
    return f" in {file}" if file is not None else ""
