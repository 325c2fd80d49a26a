"""Quantized checkpoints (block-wise FP8, GPT-OSS's MXFP4, GPTQ, AWQ and compressed-tensors' integers and FP8)
dequantized to the model's dtype as their tensors are read, as transformers does with `dequantize=True`: the layers
only ever see ordinary weights."""
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from nanoinfer.utils.loader import LazyTensor

# quant_method values with a dequantizer here, and the architectures each one serves (None: any).
SUPPORTED_METHODS: dict[str, tuple[str, ...] | None] = {"fp8": None, "mxfp4": ("GptOssForCausalLM",), "gptq": None,
                                                        "awq": None, "compressed-tensors": None}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# MXFP4's e2m1 code points, indexed by the 4-bit code (sign bit highest).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E8M0_BIAS = 127  # an e8m0 scale byte b means 2 ** (b - 127)
GPTQ_BITS = (2, 4, 8)  # the widths that fill an int32 (3-bit codes straddle words)
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v2 (GPTQModel's) stores the zero points themselves, v1 each one less
# AutoAWQ's GEMM layout packs output column AWQ_PACK_ORDER[i] of each run of 8 into bits 4i..4i+3 of a word.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# compressed-tensors' formats of quantized weights that load here, and the weight type each stores.
COMPRESSED_FORMATS = {"pack-quantized": "int", "int-quantized": "int", "naive-quantized": "int",
                      "float-quantized": "float"}
COMPRESSED_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint stores each quantized weight, as tensors named by suffixes of one base name (its quantized
    data, its scale, ...), and how they become one weight."""
    data: tuple[str, ...]  # the quantized data's suffix: one of these
    parts: tuple[str, ...]  # the suffixes of its other tensors, its scale first
    dequantize: Callable[[dict[str, torch.Tensor], torch.dtype], torch.Tensor]  # {suffix: tensor}, dtype -> weight
    weight_suffix: str = ".weight"  # the dequantized tensor's name ends so
    # Data stored unquantized, with none of the other parts beside it, passes as it is (a layer left in bf16).
    is_quantized: Callable[[torch.Tensor | LazyTensor], bool] = lambda tensor: True
    optional: tuple[str, ...] = ()  # parts a weight may go without (it has them where the checkpoint holds them)
    ignored: tuple[str, ...] = ()  # suffixes of tensors the dequantization does not need (dropped)


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
    check = {"fp8": _check_fp8, "gptq": _check_gptq, "awq": _check_awq,
             "compressed-tensors": _check_compressed_tensors}.get(method)
    if check is not None:
        check(quantization, source)


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


def _check_gptq(quantization: dict, source: Path) -> None:
    bits, fmt = quantization.get("bits"), quantization.get("checkpoint_format", "gptq")
    if bits not in GPTQ_BITS or isinstance(bits, bool):
        raise ValueError(f"quantization_config bits={bits!r} in {source}: GPTQ checkpoints load with bits "
                         f"{', '.join(map(str, GPTQ_BITS))}")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"quantization_config checkpoint_format={fmt!r} in {source}: GPTQ checkpoints load in the "
                         f"formats {', '.join(GPTQ_FORMATS)}")
    _check_group_size(quantization, source)


def _check_awq(quantization: dict, source: Path) -> None:
    bits, version = quantization.get("bits", 4), quantization.get("version", "gemm")
    if bits != 4 or isinstance(bits, bool):
        raise ValueError(f"quantization_config bits={bits!r} in {source}: AWQ checkpoints load with 4 bits")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"quantization_config version={version!r} in {source}: AWQ checkpoints load in the 'gemm' "
                         "layout (AutoAWQ's default)")
    if quantization.get("zero_point", True) is not True:
        raise ValueError(f"quantization_config zero_point={quantization['zero_point']!r} in {source}: AWQ "
                         "checkpoints load with zero points")
    _check_group_size(quantization, source)


def _check_compressed_tensors(quantization: dict, source: Path) -> None:
    """Weight-only quantization (activations dynamic or not quantized), with the same weight settings in every
    config group."""
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if quantization.get(key):
            raise ValueError(f"quantization_config {key}={quantization[key]!r} in {source}: compressed-tensors "
                             f"checkpoints load without {what}")
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config config_groups={groups!r} in {source}: expected a dict of groups")
    settings = [_compressed_group(f"config_groups.{name}", group, quantization.get("format"), source)
                for name, group in groups.items()]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"quantization_config config_groups in {source}: groups with different weight settings "
                         f"({settings}) are not supported")


def _compressed_group(where: str, group: dict, default_format: str | None, source: Path) -> dict:
    """The weight settings of one config group (what dequantizing its weights needs), or a ValueError."""
    fmt = group.get("format") or default_format
    weights = group.get("weights")
    if fmt not in COMPRESSED_FORMATS or not isinstance(weights, dict):
        raise ValueError(f"quantization_config {where}.format={fmt!r} in {source}: compressed-tensors checkpoints "
                         f"load with weights in the formats {', '.join(COMPRESSED_FORMATS)}")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    if kind != COMPRESSED_FORMATS[fmt] or isinstance(bits, bool) \
            or bits not in (range(1, 9) if kind == "int" else (8,)):
        raise ValueError(f"quantization_config {where}.weights (type={kind!r}, num_bits={bits!r}) in {source}: "
                         f"{fmt} weights load as 1 to 8-bit ints or 8-bit floats, as the format says")
    if strategy not in COMPRESSED_STRATEGIES:
        raise ValueError(f"quantization_config {where}.weights.strategy={strategy!r} in {source}: expected one of "
                         f"{', '.join(COMPRESSED_STRATEGIES)}")
    for name in ("input_activations", "output_activations"):
        args = group.get(name)
        # Dynamic input quantization is left out (activations run unquantized, as transformers' dequantize=True);
        # static scales would be dropped.
        if args and not (name == "input_activations" and args.get("dynamic") is True):
            raise ValueError(f"quantization_config {where}.{name} in {source}: only dynamic input activations "
                             "(dropped on load) are supported")
    return {key: weights.get(key) for key in ("num_bits", "type", "strategy", "group_size", "block_structure")}


def _check_group_size(quantization: dict, source: Path) -> None:
    size = quantization.get("group_size", -1)
    if isinstance(size, bool) or not isinstance(size, int) or not (size == -1 or size > 0):
        raise ValueError(f"quantization_config group_size={size!r} in {source}: expected a positive int, or -1 "
                         "(one group per column)")


def quant_scheme(hf_config: PretrainedConfig) -> QuantScheme | None:
    """The scheme of a checkpoint that check_quantization accepted; None when it is not quantized."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    method, group_size = quantization["quant_method"], quantization.get("group_size", -1)
    if method == "mxfp4":
        return QuantScheme(("_blocks",), ("_scales",), lambda t, dtype: dequantize_mxfp4(t["_blocks"], t["_scales"],
                                                                                            dtype), weight_suffix="")
    if method == "gptq":
        bits, v1 = quantization["bits"], quantization.get("checkpoint_format", "gptq") == "gptq"
        # As vLLM: without act-order (desc_act) the rows' groups are their blocks of group_size, whatever g_idx says.
        act_order = bool(quantization.get("desc_act", False))
        return QuantScheme((".qweight",), (".scales", ".qzeros") + (".g_idx",) * act_order, lambda t, dtype:
                           dequantize_gptq(t[".qweight"], t[".scales"], t[".qzeros"], t.get(".g_idx"), bits,
                                           group_size, v1, dtype), ignored=() if act_order else (".g_idx",))
    if method == "awq":
        return QuantScheme((".qweight",), (".scales", ".qzeros"), lambda t, dtype: dequantize_awq(
            t[".qweight"], t[".scales"], t[".qzeros"], group_size, dtype))
    if method == "compressed-tensors":
        weights = next(iter(quantization["config_groups"].values()))["weights"]
        return QuantScheme((".weight_packed", ".weight"), (".weight_scale", ".weight_shape", ".weight_zero_point",
                                                           ".weight_g_idx"),
                           lambda t, dtype: dequantize_compressed(t, weights, dtype), is_quantized=_stored_as_codes,
                           optional=(".weight_shape", ".weight_zero_point", ".weight_g_idx"))
    block = quantization.get("weight_block_size")
    return QuantScheme((".weight",), (".weight_scale_inv",), lambda t, dtype: dequantize_fp8(
        t[".weight"], t[".weight_scale_inv"], None if block is None else tuple(block), dtype),
        is_quantized=_stored_as_fp8)


def _stored_as_fp8(tensor: torch.Tensor | LazyTensor) -> bool:
    if isinstance(tensor, LazyTensor):
        return tensor.stored_dtype.startswith("F8_")
    return tensor.dtype in _FP8_DTYPES


def _stored_as_codes(tensor: torch.Tensor | LazyTensor) -> bool:
    """Integers or FP8, not a float weight left unquantized."""
    if isinstance(tensor, LazyTensor):
        return tensor.stored_dtype.startswith(("I", "U", "F8_"))
    return not tensor.is_floating_point() or tensor.dtype in _FP8_DTYPES


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


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` codes of each row of int32 words [rows, words], read as a stream of bits-wide codes from
    each word's lowest bits up (a code may straddle two words) -> [rows, count] int64."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or -(-count * bits // 32) > packed.shape[1]:
        raise ValueError(f"packed codes {packed.dtype} {list(packed.shape)}: expected int32 words [rows, "
                         f"{-(-count * bits // 32)}] for {count} codes of {bits} bits")
    words = torch.nn.functional.pad(packed.long() & 0xFFFFFFFF, (0, 1))  # a straddling code reads the next word
    start = torch.arange(count, device=packed.device) * bits
    low, shift = words[:, start // 32] >> (start % 32), 32 - start % 32
    return (low | words[:, start // 32 + 1] << shift) & ((1 << bits) - 1)


def dequantize_gptq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, group_size: int, v1: bool, dtype: torch.dtype) -> torch.Tensor:
    """A GPTQ linear weight: qweight [in / w, out] (w = 32 // bits codes a word, along the input), qzeros
    [groups, out / w] (along the output; v1 stores each zero point less one, so a stored 2 ** bits - 1 reads as
    2 ** bits, as vLLM's kernels read it), scales [groups, out], g_idx [in] (each input row's group; None: rows in
    blocks of group_size) -> [out, in] = scale * (code - zero)."""
    rows, columns = qweight.shape[0] * 32 // bits, qweight.shape[1]
    codes = unpack_bits(qweight.T.contiguous(), bits, rows)
    zeros = unpack_bits(qzeros, bits, columns).T + int(v1)
    return dequantize_groups(codes, scales.T, zeros, _groups(rows, group_size, g_idx, scales.shape[0]), dtype)


def dequantize_awq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """An AWQ (GEMM layout) linear weight: qweight [in, out / 8] and qzeros [groups, out / 8], 4-bit codes along
    the output in AWQ_PACK_ORDER, scales [groups, out] -> [out, in] = scale * (code - zero)."""
    codes, zeros = _unpack_awq(qweight).T, _unpack_awq(qzeros).T
    return dequantize_groups(codes, scales.T, zeros, _groups(codes.shape[1], group_size, None, scales.shape[0]),
                             dtype)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    codes = unpack_bits(packed, 4, packed.shape[1] * 8)
    columns = torch.tensor(AWQ_PACK_ORDER, device=codes.device).argsort()  # column c sits in nibble columns[c]
    return codes.view(codes.shape[0], -1, 8)[..., columns].flatten(-2)


def _groups(columns: int, group_size: int, g_idx: torch.Tensor | None, num_groups: int) -> torch.Tensor:
    """Each input column's group: its g_idx entry, else its block of group_size columns (-1: one block)."""
    if g_idx is not None:
        if tuple(g_idx.shape) != (columns,):
            raise ValueError(f"g_idx has shape {list(g_idx.shape)}: expected [{columns}], one per input column")
        return g_idx.long()
    size = columns if group_size == -1 else group_size
    if -(-columns // size) != num_groups:
        raise ValueError(f"{num_groups} groups of scales for {columns} input columns: expected {-(-columns // size)} "
                         f"with group_size {group_size}")
    return torch.arange(columns) // size


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, groups: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """codes [out, in], scales and zero points (None: 0) [out, groups], input column j in group groups[j] -> the
    weight scale * (code - zero) [out, in] in dtype, computed in fp32."""
    groups = groups.to(codes.device)
    if scales.dim() != 2 or scales.shape[0] != codes.shape[0] or zeros is not None and zeros.shape != scales.shape \
            or not 0 <= int(groups.min()) <= int(groups.max()) < scales.shape[1]:
        raise ValueError(f"codes {list(codes.shape)}, scales {list(scales.shape)}, zero points "
                         f"{None if zeros is None else list(zeros.shape)} and groups {int(groups.min())}.."
                         f"{int(groups.max())} do not fit together")
    values = codes.float() if zeros is None else (codes - zeros[:, groups]).float()
    return (values * scales.float()[:, groups]).to(dtype)


def dequantize_compressed(tensors: dict[str, torch.Tensor], weights: dict, dtype: torch.dtype) -> torch.Tensor:
    """A compressed-tensors linear weight [out, in] = scale * (code - zero), from `weights` (a config group's settings)
    and the tensors by suffix: the codes, either `weight_packed` int32 [out, ceil(in * bits / 32)] (each row a bit
    stream from the lowest bits up, a code stored plus 2 ** (bits - 1)) with `weight_shape` [out, in], or `weight`
    int8 / fp8 [out, in]; `weight_scale` [1] (tensor), [out, 1] (channel), [out, groups] (group: input column j in
    group j // group_size, or weight_g_idx[j]) or one per block; `weight_zero_point` beside it where the weights are
    asymmetric (packed as the codes, along the output, in weight_packed's format)."""
    scale, zero, g_idx = (tensors[".weight_scale"].float(), tensors.get(".weight_zero_point"),
                          tensors.get(".weight_g_idx"))
    if ".weight_packed" in tensors:
        if ".weight_shape" not in tensors:
            raise ValueError("weight_packed comes without its weight_shape")
        (rows, columns), bits = tensors[".weight_shape"].tolist(), weights["num_bits"]
        offset = 1 << (bits - 1)
        codes = unpack_bits(tensors[".weight_packed"], bits, columns) - offset
        if zero is not None:
            zero = unpack_bits(zero.T.contiguous(), bits, rows).T - offset
    else:
        codes = tensors[".weight"]
    if weights["strategy"] == "block":
        if zero is not None:
            raise ValueError("block-quantized weights with zero points are not supported")
        return dequantize_fp8(codes.float(), scale, tuple(weights["block_structure"]), dtype)
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    zero = zero.reshape(1, 1) if zero is not None and zero.numel() == 1 else zero
    if scale.shape[0] == 1:  # one scale for the tensor: every row and column shares it
        scale, zero = scale.expand(codes.shape[0], 1), None if zero is None else zero.expand(codes.shape[0], 1)
    group_size = weights.get("group_size") if weights["strategy"] == "group" else -1
    groups = _groups(codes.shape[1], group_size or -1, g_idx, scale.shape[1])
    return dequantize_groups(codes if zero is None else codes.long(), scale, zero, groups, dtype)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor | LazyTensor]], names: set[str],
                        scheme: QuantScheme, device: torch.device, dtype: torch.dtype
                        ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """The checkpoint's tensors (`names`: all of theirs) with the parts of each quantized weight (its data, scale,
    ...: in any order, in any of the files) replaced by the weight they make, dequantized on `device` to `dtype`;
    every other tensor passes as it is, but those the scheme ignores."""
    suffixes = sorted(scheme.data + scheme.parts, key=len, reverse=True)  # ".weight_scale" is no ".weight"
    # Parts are held on the host until the last of their weight's arrives (usually soon, in the same file).
    pending: dict[str, dict[str, tuple[torch.Tensor, Path | None]]] = {}
    for name, tensor in weights:
        if name.endswith(scheme.ignored):
            continue
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        base = "" if suffix is None else name.removesuffix(suffix)
        if suffix is None or suffix in scheme.data and not scheme.is_quantized(tensor) \
                and not any(base + part in names for part in scheme.parts):
            yield name, tensor
            continue
        parts = pending.setdefault(base, {})
        parts[suffix] = (tensor[...] if isinstance(tensor, LazyTensor) else tensor, getattr(tensor, "file", None))
        if not _missing_parts(base, parts, names, scheme):
            yield base + scheme.weight_suffix, _dequantize(scheme, base, pending.pop(base), device, dtype)
    for base, parts in pending.items():
        data = next((s for s in scheme.data if s in parts), None)
        if data is None:
            part, (_, file) = next(iter(parts.items()))
            raise ValueError(f"checkpoint tensor {base + part!r}{_in(file)} belongs to no quantized tensor: "
                             f"{' or '.join(repr(base + s) for s in scheme.data)} is missing or not quantized")
        raise ValueError(f"quantized checkpoint tensor {base + data!r}{_in(parts[data][1])} lacks "
                         f"{', '.join(map(repr, _missing_parts(base, parts, names, scheme)))} in the checkpoint")


def _missing_parts(base: str, parts: dict, names: set[str], scheme: QuantScheme) -> list[str]:
    """The names of the parts of base's weight not yet read: its data and the parts it has, or must have."""
    missing = [] if any(s in parts for s in scheme.data) else [base + scheme.data[0]]
    return missing + [base + s for s in scheme.parts
                      if s not in parts and (s not in scheme.optional or base + s in names)]


def _dequantize(scheme: QuantScheme, base: str, parts: dict[str, tuple[torch.Tensor, Path | None]],
                device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    data = next(s for s in scheme.data if s in parts)
    try:
        return scheme.dequantize({suffix: tensor.to(device) for suffix, (tensor, _) in parts.items()}, dtype)
    except ValueError as e:
        raise ValueError(f"cannot dequantize checkpoint tensor {base + data!r}{_in(parts[data][1])}: {e}") from None


def _in(file: Path | None) -> str:
    return f" in {file}" if file is not None else ""
