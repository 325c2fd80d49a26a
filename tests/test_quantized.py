"""Quantized checkpoints dequantized on load: block-wise FP8 (Qwen3, DeepSeek-V3; TP 1 and 2) and GPT-OSS's MXFP4
against transformers loading the same files with `dequantize=True`; GPTQ and AWQ integers against transformers on the
weights they stand for; compressed-tensors' formats, written by its own library, against transformers reading them;
the edge tiles of FP8 blocks, the packed layouts word by word, and the checkpoints and settings refused by name
(other quant methods, a missing or misshapen part)."""
import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import check_against_hf, hf_greedy, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.utils.quantization import (dequantize_awq, dequantize_compressed, dequantize_fp8, dequantize_gptq,
                                          dequantized_weights, quant_scheme, unpack_bits)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(3, 5, 440, 5, 50, seed=61) + [[17]]
LOGIT_ATOL = 1e-4
CUDA_FP32_LOGIT_ATOL = 2e-4  # as tests/test_gpu.py: GPU reductions run in other orders
FP8_MAX = 448.0  # float8_e4m3fn's largest value
# Non-square blocks that tile every projection of the tiny models (transformers derives the tile from the scale
# grid's shape, so it only agrees with the block size where the blocks divide the weights).
FP8_BLOCKS = {"qwen3": (32, 16), "deepseek-v3": (8, 16)}
_HF_REFERENCES: dict[str, list[dict]] = {}


def fp8_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv [rows / bm, cols / bn]) with each tile's largest |value| at FP8_MAX."""
    rows, cols = weight.shape
    tiles = weight.reshape(rows // block[0], block[0], cols // block[1], block[1])
    scale_inv = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    return (tiles / scale_inv[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn), scale_inv


def fp8_copy(src: pathlib.Path, dst: pathlib.Path, block: tuple[int, int], split_scales: bool = False,
             drop: str | None = None, **settings) -> pathlib.Path:
    """src's model in dst with every projection weight block-quantized to FP8, as DeepSeek's and Qwen's FP8
    releases are (embeddings, norms, routers and lm_head stay as they were). split_scales: the scales in a shard
    file of their own, read before the weights'; drop: a tensor left out."""
    shutil.copytree(src, dst)
    weights, scales = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if "proj" in name and name.endswith(".weight"):
            weights[name], scales[name + "_scale_inv"] = fp8_quantize(w, block)
        else:
            weights[name] = w
    (dst / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": scales, "model-00002-of-00002.safetensors": weights} \
        if split_scales else {"model.safetensors": {**weights, **scales}}
    for file, tensors in files.items():
        save_file({n: t for n, t in tensors.items() if n != drop}, dst / file)
    if split_scales:  # transformers reads a sharded checkpoint through its index
        weight_map = {n: file for file, tensors in files.items() for n in tensors}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), **settings}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's release format of an expert weight [experts, in, out]: blocks [experts, out, in / 32, 16] (the
    nearest e2m1 codes of each 32 values over their power-of-two scale, two a byte, low nibble first) and scales
    [experts, out, in / 32] (that power's exponent + 127)."""
    experts, columns, rows = weight.shape
    groups = weight.transpose(1, 2).reshape(experts, rows, columns // 32, 32)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1) / 6)).clamp(min=-127)  # the largest |value| <= 6
    codes = ((groups / torch.exp2(exponents)[..., None])[..., None] - E2M1_VALUES).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)


def mxfp4_copy(src: pathlib.Path, dst: pathlib.Path, drop: str | None = None) -> pathlib.Path:
    """src's GPT-OSS model in dst with its experts' weights in MXFP4, as OpenAI released GPT-OSS (attention,
    router, embeddings, biases as they were); drop: a tensor left out."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_quantize(w)
        else:
            tensors[name] = w
    save_file({n: t for n, t in tensors.items() if n != drop}, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def int_quantize(weight: torch.Tensor, bits: int, groups: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, ...]:
    """Min-max integer quantization of weight [out, in] by groups of input rows (row i in group groups[i]), as GPTQ
    and AWQ store it: codes [in, out], zero points (at least min_zero) and fp16 scales [groups, out]; and the fp32
    weight [out, in] they stand for, scale * (code - zero)."""
    w, maxq, n = weight.T, (1 << bits) - 1, int(groups.max()) + 1
    lo = torch.stack([w[groups == g].amin(0) for g in range(n)]).clamp(max=0)
    hi = torch.stack([w[groups == g].amax(0) for g in range(n)]).clamp(min=0)
    scales = ((hi - lo) / maxq).clamp(min=1e-6).half()
    zeros = torch.round(-lo / scales.float()).clamp(min_zero, maxq).int()
    codes = (torch.round(w / scales.float()[groups]) + zeros[groups]).clamp(0, maxq).int()
    return codes, zeros, scales, ((codes - zeros[groups]) * scales.float()[groups]).T.contiguous()


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensors checkpoints store (the top bit is the sign)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def gptq_pack(codes: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's packing, written as its loops are: word i of qweight's column holds rows i * w + j (w = 32 // bits)
    in bits j * bits and up; qzeros packs the zero points (less one in v1) along the output the same way."""
    per, mask = 32 // bits, (1 << bits) - 1
    qweight = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        qweight |= codes[j::per].long() << (bits * j)
        qzeros |= ((zeros[:, j::per].long() - int(v1)) & mask) << (bits * j)
    return as_int32(qweight), as_int32(qzeros)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of [rows, out] 4-bit codes: nibble i of each word holds column [0, 2, 4, 6, 1, 3, 5,
    7][i] of its run of 8."""
    packed = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        packed |= codes[:, column::8].long() << (4 * i)
    return as_int32(packed)


def int_quantized_copy(src: pathlib.Path, dst: pathlib.Path, reference: pathlib.Path, quantization: dict,
                       drop: str | None = None, seed: int = 0) -> pathlib.Path:
    """src's model in dst with every projection (not the routers, embeddings or LM head) quantized to GPTQ's or
    AWQ's integers as `quantization` (a quantization_config) says, GPTQ's rows in random groups with desc_act; and
    in `reference` the same model with the weights those integers stand for, unquantized, for transformers."""
    gen = torch.Generator().manual_seed(seed)
    method, bits, size = quantization["quant_method"], quantization.get("bits", 4), quantization["group_size"]
    quantized, dequantized = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not ("proj" in name and name.endswith(".weight")):
            quantized[name] = dequantized[name] = w
            continue
        rows = w.shape[1]
        groups = torch.arange(rows) // (rows if size == -1 else size)
        if quantization.get("desc_act"):  # act-order: the groups follow a permutation of the rows
            groups = groups[torch.randperm(rows, generator=gen).argsort()]
        # GPTQ's v1 format stores each zero point less one, so it has no 0 (symmetric quantization, GPTQ's default,
        # never makes one: its zero points sit at 2 ** (bits - 1)).
        v1 = method == "gptq" and quantization.get("checkpoint_format", "gptq") == "gptq"
        codes, zeros, scales, dequantized[name] = int_quantize(w, bits, groups, min_zero=int(v1))
        base = name.removesuffix(".weight")
        if method == "gptq":
            quantized[base + ".qweight"], quantized[base + ".qzeros"] = gptq_pack(codes, zeros, bits, v1)
            quantized[base + ".g_idx"] = groups.int()
        else:
            quantized[base + ".qweight"], quantized[base + ".qzeros"] = awq_pack(codes), awq_pack(zeros)
        quantized[base + ".scales"] = scales
    for d, tensors in ((dst, quantized), (reference, dequantized)):
        shutil.copytree(src, d)
        save_file({n: t.contiguous() for n, t in tensors.items() if n != drop}, d / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return dst


@pytest.fixture(scope="module")
def quantized_dir(model_dir, tmp_path_factory):
    """quantized_dir(kind): the test model of `kind` quantized (GPT-OSS's experts to MXFP4, the others' projections
    to FP8), built once per module."""
    built: dict[str, pathlib.Path] = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in built:
            dst = tmp_path_factory.mktemp("quantized") / kind
            built[kind] = mxfp4_copy(model_dir(kind), dst) if kind == "gpt-oss" else \
                fp8_copy(model_dir(kind), dst, FP8_BLOCKS[kind], split_scales=kind == "qwen3")
        return built[kind]
    return get


def hf_dequantized_greedy(d: pathlib.Path, monkeypatch) -> list[dict]:
    """transformers' greedy tokens and logits from the quantized files (FP8 or MXFP4), dequantized on load, in fp32
    arithmetic."""
    if str(d) not in _HF_REFERENCES:
        import transformers.quantizers.quantizer_finegrained_fp8 as quantizer
        from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

        # The FP8 environment check asks for accelerate, which the dequantizing path never uses.
        monkeypatch.setattr(quantizer, "is_accelerate_available", lambda: True)
        quantization = json.loads((d / "config.json").read_text())["quantization_config"]
        dequantize = Mxfp4Config(dequantize=True) if quantization["quant_method"] == "mxfp4" else \
            FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(quantization["weight_block_size"]))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=dequantize)
        assert not any(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in model.parameters())
        # transformers 5.17 (the GPU machine's) keeps dequantized MXFP4 experts in bf16, which holds them exactly:
        # fp32 arithmetic on the same values, as 5.23 does.
        _HF_REFERENCES[str(d)] = hf_greedy(model.float().eval(), PROMPTS, MAX_TOKENS)
    return _HF_REFERENCES[str(d)]


@pytest.mark.parametrize("kind, tp", [("qwen3", 1), ("deepseek-v3", 1), ("qwen3", 2)])
def test_fp8_matches_transformers_dequantized(kind, tp, quantized_dir, model_dir, captured_logits, monkeypatch,
                                              report_logit_diff):
    """Qwen3 (scales in a shard read before the weights) and DeepSeek-V3 (per-expert weights, MLA's kv_b_proj
    that the engine absorbs) load their FP8 weights dequantized: transformers' tokens and logits; two ranks each
    dequantize a tensor and keep their shard."""
    d = quantized_dir(kind)
    worst = check_quantized(d, hf_dequantized_greedy(d, monkeypatch), model_dir(kind), tp, captured_logits)
    report_logit_diff(f"{kind} FP8, tensor parallel {tp}", worst)


def check_quantized(d: pathlib.Path, refs: list[dict], unquantized_dir: pathlib.Path, tp: int,
                    captured_logits) -> float:
    """The engine on the quantized checkpoint d (fp32, tp ranks) against transformers' refs (tokens, and logits
    within LOGIT_ATOL: the largest difference is returned); and the quantization shows in refs: the unquantized
    model's logits would not have matched them."""
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, refs, captured_logits)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    unquantized = hf_greedy(unquantized_dir, PROMPTS[:1], MAX_TOKENS)[0]["logits"]
    assert (unquantized - refs[0]["logits"]).abs().max() > 100 * LOGIT_ATOL
    return worst


def test_fp8_edge_tiles_are_cut_short():
    """A weight the blocks do not divide: scale (i // bm, j // bn) covers element (i, j), the last row and column
    of tiles narrower, as DeepSeek's own dequantization kernel and vLLM read them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(45, 70, generator=g).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 5, generator=g) + 0.5  # ceil(45 / 16), ceil(70 / 16)
    expected = torch.empty(45, 70)
    for i in range(45):
        for j in range(70):
            expected[i, j] = weight[i, j].float() * scale_inv[i // 16, j // 16]
    assert torch.equal(dequantize_fp8(weight, scale_inv, (16, 16), torch.float32), expected)
    with pytest.raises(ValueError, match=r"FP8 scale has shape \[3, 4\], weight \[45, 70\]: expected \[3, 5\]"):
        dequantize_fp8(weight, scale_inv[:, :4], (16, 16), torch.float32)


def test_fp8_ue8m0_scales_are_powers_of_two():
    """`scale_fmt: ue8m0` checkpoints store each scale as an e8m0 exponent byte b, meaning 2 ** (b - 127)."""
    weight = torch.randn(32, 32).to(torch.float8_e4m3fn)
    exponents = torch.tensor([[120, 127], [128, 133]], dtype=torch.uint8)
    as_floats = torch.exp2(exponents.float() - 127)
    dequantized = dequantize_fp8(weight, exponents, (16, 16), torch.float32)
    assert torch.equal(dequantized, dequantize_fp8(weight, as_floats, (16, 16), torch.float32))
    assert torch.equal(dequantized[16:, 16:], weight[16:, 16:].float() * 64)


def test_fp8_dequantizes_on_the_target_device():
    """Each weight and its scale go to the model's device before they are combined (on a GPU: no full-precision
    copy of the model on the host); unquantized tensors pass through untouched."""
    config = type("Config", (), {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    weight, scale_inv = fp8_quantize(torch.randn(32, 32), (16, 16))
    norm = torch.ones(32)
    weights = [("a.weight_scale_inv", scale_inv), ("a.weight", weight), ("norm.weight", norm)]
    out = dict(dequantized_weights(weights, {name for name, _ in weights}, quant_scheme(config), torch.device("meta"),
                                   torch.bfloat16))
    assert out.keys() == {"a.weight", "norm.weight"} and out["norm.weight"] is norm
    assert out["a.weight"].device.type == "meta" and out["a.weight"].dtype == torch.bfloat16


INT_QUANTIZED = {  # (kind, tensor-parallel size, quantization_config)
    "qwen3-gptq4-g32": ("qwen3", 1, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}),
    "qwen3-gptq8-v2-actorder-tp2": ("qwen3", 2, {"quant_method": "gptq", "bits": 8, "group_size": 16,
                                                  "desc_act": True, "checkpoint_format": "gptq_v2"}),
    "qwen3-moe-gptq2-actorder": ("qwen3-moe", 1, {"quant_method": "gptq", "bits": 2, "group_size": 16,
                                                  "desc_act": True}),
    "llama-awq-g32": ("llama", 1, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM",
                                   "zero_point": True}),
    "qwen3-moe-awq-per-column-tp2": ("qwen3-moe", 2, {"quant_method": "awq", "bits": 4, "group_size": -1,
                                                      "version": "gemm", "zero_point": True}),
}


@pytest.mark.parametrize("case", INT_QUANTIZED)
def test_gptq_and_awq_match_transformers_on_the_weights_they_stand_for(case, model_dir, tmp_path, captured_logits,
                                                                       report_logit_diff):
    """GPTQ (2, 4 and 8 bits, v1 and v2 zero points, act-order's g_idx, per-expert weights) and AWQ (GEMM layout,
    groups and one group per column) load dequantized: transformers' tokens and logits on the weights the integers
    stand for; with two ranks, each dequantizes a tensor and keeps its shard."""
    kind, tp, quantization = INT_QUANTIZED[case]
    d = int_quantized_copy(model_dir(kind), tmp_path / "q", tmp_path / "reference", quantization)
    refs = hf_greedy(tmp_path / "reference", PROMPTS, MAX_TOKENS)
    report_logit_diff(case, check_quantized(d, refs, model_dir(kind), tp, captured_logits))


def test_packed_words_unpack_from_the_lowest_bits_in_each_layout():
    """One word per layout, by hand: 0x76543210 holds the codes 0..7 from its lowest nibble up, along GPTQ's input
    rows, and along AWQ's output columns in AutoAWQ's order (nibble i: column [0, 2, 4, 6, 1, 3, 5, 7][i]); a word
    with its top bit set (negative as int32) unpacks the same way; GPTQ v1 adds one to each stored zero point."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_bits(word, 4, 8).flatten().tolist() == list(range(8))
    assert unpack_bits(as_int32(torch.tensor([[0x89ABCDEF]])), 4, 8).flatten().tolist() == [15, 14, 13, 12, 11, 10, 9,
                                                                                             8]
    assert unpack_bits(as_int32(torch.tensor([[0xC0FF03E4]])), 8, 4).flatten().tolist() == [0xE4, 0x03, 0xFF, 0xC0]
    # 3-bit codes straddle words: the eleventh sits in bits 30 to 32.
    codes = [(5 * i + 3) % 8 for i in range(11)]
    stream = sum(c << (3 * i) for i, c in enumerate(codes))
    words = as_int32(torch.tensor([[stream & 0xFFFFFFFF, stream >> 32]]))
    assert unpack_bits(words, 3, 11).flatten().tolist() == codes
    one, zero = torch.ones(1, 8, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.int32)
    awq = dequantize_awq(word, one, zero, -1, torch.float32)  # [out 8, in 1]
    assert awq.flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    gptq = dequantize_gptq(word.expand(1, 8).contiguous(), one, zero, None, 4, -1, True, torch.float32)  # [8, 8]
    assert torch.equal(gptq, (torch.arange(8.0) - 1).expand(8, 8))
    v2 = dequantize_gptq(word.expand(1, 8).contiguous(), one, zero, None, 4, -1, False, torch.float32)
    assert torch.equal(v2, gptq + 1)
    with pytest.raises(ValueError, match=r"groups 1..1 do not fit together"):  # a g_idx past the one group
        dequantize_gptq(word.expand(1, 8).contiguous(), one, zero, torch.ones(8, dtype=torch.int32), 4, -1, True,
                        torch.float32)


@pytest.mark.parametrize("method, drop, message", [
    ("gptq", "model.layers.1.mlp.up_proj.qzeros",
     r"quantized checkpoint tensor 'model.layers.1.mlp.up_proj.qweight' in .*model.safetensors lacks "
     r"'model.layers.1.mlp.up_proj.qzeros' in the checkpoint"),
    ("awq", "model.layers.0.self_attn.k_proj.qweight",
     r"'model.layers.0.self_attn.k_proj.(scales|qzeros)' in .*model.safetensors belongs to no quantized tensor: "
     r"'model.layers.0.self_attn.k_proj.qweight' is missing"),
    ("gptq", None, r"cannot dequantize checkpoint tensor 'model.layers.0.mlp.down_proj.qweight' in "
                   r".*model.safetensors: 4 groups of scales for 128 input columns: expected 8 with group_size "
                   r"16"),
], ids=["gptq-zeros-missing", "awq-qweight-missing", "gptq-group-size-wrong"])
def test_gptq_and_awq_missing_or_misshapen_parts_name_the_tensor(qwen3_dir, tmp_path, method, drop, message):
    quantization = {"quant_method": method, "bits": 4, "group_size": 32}
    d = int_quantized_copy(qwen3_dir, tmp_path / "q", tmp_path / "reference", quantization, drop=drop)
    if drop is None:  # the config's groups disagree with the scales'
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"]["group_size"] = 16
        (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(d), max_model_len=64, device="cpu")


def compressed_copy(src: pathlib.Path, dst: pathlib.Path, group: dict, fmt: str) -> pathlib.Path:
    """src's model in dst as llm-compressor saves one: compressed-tensors' own library quantizes every Linear but the
    LM head with the settings of `group` (min-max scales and zero points by its own formula) and compresses them in
    format `fmt`."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig.model_validate({
        "config_groups": {"group_0": {"targets": ["Linear"], **group}}, "ignore": ["lm_head"], "format": fmt}))
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            w, args = module.weight, scheme.weights
            if args.strategy == "tensor":
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                lo, hi = (f(w.reshape(w.shape[0], -1, args.group_size), -1) for f in (torch.amin, torch.amax))
            else:
                (bo, bi), (rows, cols) = args.block_structure, w.shape
                lo, hi = (f(w.reshape(rows // bo, bo, cols // bi, bi), (1, 3)) for f in (torch.amin, torch.amax))
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.CALIBRATION
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    model.save_pretrained(dst)
    compressor.update_config(dst)
    return dst


def int_weights(bits: int, strategy: str, symmetric: bool = True, **more) -> dict:
    return {"weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, **more}}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True}
COMPRESSED = {  # (kind, tensor-parallel size, config group, format)
    "qwen3-w4a16-group32": ("qwen3", 1, int_weights(4, "group", group_size=32), "pack-quantized"),
    "llama-w4a16-asymmetric-tp2": ("llama", 2, int_weights(4, "group", False, group_size=16), "pack-quantized"),
    "qwen3-w3a16-asymmetric-channel": ("qwen3", 1, int_weights(3, "channel", False), "pack-quantized"),
    "llama-w8a16-channel": ("llama", 1, int_weights(8, "channel"), "pack-quantized"),
    "qwen3-int8-channel": ("qwen3", 1, int_weights(8, "channel"), "int-quantized"),
    "qwen3-fp8-channel-dynamic-activations": ("qwen3", 1, {"weights": {**FP8_WEIGHTS, "strategy": "channel"}},
                                              "float-quantized"),
    "qwen3-fp8-tensor": ("qwen3", 1, {"weights": {**FP8_WEIGHTS, "strategy": "tensor"}}, "float-quantized"),
    "qwen3-fp8-block-tp2": ("qwen3", 2, {"weights": {**FP8_WEIGHTS, "strategy": "block", "block_structure": [32, 16]}},
                            "float-quantized"),
}


@pytest.mark.parametrize("case", COMPRESSED)
def test_compressed_tensors_match_transformers(case, model_dir, tmp_path, captured_logits, report_logit_diff):
    """compressed-tensors checkpoints, written by that library as llm-compressor writes them (packed 3, 4 and 8-bit
    ints, symmetric and with zero points, by group, channel and tensor; int8; FP8 by channel, tensor and block), load
    dequantized: transformers' tokens and logits from the same files (which it decompresses with that library);
    with two ranks, each dequantizes a tensor and keeps its shard."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes these checkpoints (the test extra)")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kind, tp, group, fmt = COMPRESSED[case]
    d = compressed_copy(model_dir(kind), tmp_path / "q", group, fmt)
    if case.endswith("dynamic-activations"):  # left out on load, as transformers' decompressed model leaves them
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
        (d / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(run_compressed=False))
    assert not any(p.dtype in (torch.int32, torch.int8, torch.float8_e4m3fn) for p in reference.parameters())
    refs = hf_greedy(reference.eval(), PROMPTS, MAX_TOKENS)
    report_logit_diff(case, check_quantized(d, refs, model_dir(kind), tp, captured_logits))


def test_compressed_tensors_g_idx_orders_the_groups():
    """Older llm-compressor checkpoints (act-order "group") store weight_g_idx: input column j takes the scale and
    zero point of group weight_g_idx[j]."""
    codes = torch.arange(-4, 4, dtype=torch.int8).repeat(2, 1)  # [out 2, in 8]
    scale = torch.tensor([[1.0, 10.0], [2.0, 20.0]])
    g_idx = torch.tensor([1, 0, 0, 1, 1, 0, 0, 1], dtype=torch.int32)
    weights = {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 4}
    out = dequantize_compressed({".weight": codes, ".weight_scale": scale, ".weight_g_idx": g_idx}, weights,
                                torch.float32)
    assert torch.equal(out, codes.float() * scale[:, g_idx.long()])
    blocks = dequantize_compressed({".weight": codes, ".weight_scale": scale}, weights, torch.float32)
    assert torch.equal(blocks, codes.float() * scale.repeat_interleave(4, 1))


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 3}, r"bits=3 .*GPTQ checkpoints load with bits 2, 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size=0"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"zero_point=False"),
    ({"quant_method": "awq", "bits": 8}, r"bits=8 .*AWQ checkpoints load with 4 bits"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, r"config_groups=None .*expected a dict of groups"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     r"config_groups.g.format='nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                              "input_activations": {"num_bits": 8, "type": "int", "dynamic": False}}}},
     r"config_groups.g.input_activations .*only dynamic input activations"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"a": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}},
                        "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"groups with different weight settings"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "sparsity_config": {"format": "sparse-24"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
     r"sparsity_config=.*without sparsity"),
    ({"quant_method": "mxfp4"}, r"quant_method='mxfp4'.* not supported for Qwen3ForCausalLM"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
], ids=["gptq-3-bit", "gptq-marlin", "gptq-group-0", "awq-gemv", "awq-no-zero-point", "awq-8-bit", "bitsandbytes",
        "compressed-tensors-no-groups", "compressed-tensors-nvfp4", "compressed-tensors-static-activations",
        "compressed-tensors-mixed", "compressed-tensors-sparse", "mxfp4-not-gpt-oss", "fp8-static", "fp8-bad-block"])
def test_unsupported_quantization_is_refused_by_name(qwen3_dir, tmp_path, quantization, message):
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=f"quantization_config.*{message}") as e:
        LLM(str(d), max_model_len=64, device="cpu")
    assert str(d / "config.json") in str(e.value)


@pytest.mark.parametrize("drop, block, message", [
    ("model.layers.1.mlp.up_proj.weight_scale_inv", (32, 16),
     r"quantized checkpoint tensor 'model.layers.1.mlp.up_proj.weight' in .*model.safetensors lacks "
     r"'model.layers.1.mlp.up_proj.weight_scale_inv'"),
    ("model.layers.1.mlp.up_proj.weight", (32, 16),
     r"'model.layers.1.mlp.up_proj.weight_scale_inv' in .*model.safetensors belongs to no quantized tensor"),
    (None, (16, 16), r"cannot dequantize checkpoint tensor 'model.layers.0.mlp.down_proj.weight' in "
                     r".*model.safetensors: FP8 scale has shape \[2, 8\], weight \[64, 128\]: expected \[4, 8\]"),
], ids=["scale-missing", "weight-missing", "scale-misshapen"])
def test_fp8_scale_missing_or_misshapen_names_the_tensor(qwen3_dir, tmp_path, drop, block, message):
    d = fp8_copy(qwen3_dir, tmp_path / "m", (32, 16), drop=drop)
    if block != (32, 16):  # the config's blocks disagree with the scales' grid
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = list(block)
        (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(d), max_model_len=64, device="cpu")


def test_mxfp4_gpt_oss_matches_transformers_dequantized(quantized_dir, model_dir, tmp_path, captured_logits,
                                                        monkeypatch, report_logit_diff):
    """GPT-OSS's MXFP4 experts load dequantized: transformers' tokens and logits from the same file; a block
    without its scales is a ValueError naming both and the file."""
    d = quantized_dir("gpt-oss")
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    refs = hf_dequantized_greedy(d, monkeypatch)
    worst = check_against_hf(outputs, refs, captured_logits)
    report_logit_diff("gpt-oss MXFP4", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    src = model_dir("gpt-oss")
    unquantized = hf_greedy(src, PROMPTS[:1], MAX_TOKENS)[0]["logits"]
    assert (unquantized - refs[0]["logits"]).abs().max() > 100 * LOGIT_ATOL
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    d = mxfp4_copy(src, tmp_path / "no-scales", drop=scales)
    with pytest.raises(ValueError, match=rf"'model.layers.1.mlp.experts.down_proj_blocks' in .*model.safetensors "
                                         rf"lacks '{scales}'"):
        LLM(str(d), max_model_len=64, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss"])
def test_quantized_on_cuda_dequantize_there_and_match_transformers(kind, quantized_dir, captured_logits, monkeypatch,
                                                                   report_logit_diff):
    """On a GPU (where the weights are combined) the FP8 dequantization gives the CPU's values bit for bit, and the
    engine in fp32 gives transformers' tokens and logits from the same FP8 and MXFP4 files."""
    weight, scale_inv = fp8_quantize(torch.randn(256, 384), (128, 128))
    on_host = dequantize_fp8(weight, scale_inv, (128, 128), torch.float32)
    assert torch.equal(dequantize_fp8(weight.cuda(), scale_inv.cuda(), (128, 128), torch.float32).cpu(), on_host)
    d = quantized_dir(kind)
    with LLM(str(d), device="cuda", dtype="float32", max_model_len=128, num_kvcache_blocks=64) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, hf_dequantized_greedy(d, monkeypatch), captured_logits)
    report_logit_diff(f"{kind} quantized, CUDA fp32", worst)
    assert worst < CUDA_FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["qwen3-gptq4-g32", "llama-awq-g32"])
def test_gptq_and_awq_on_cuda_dequantize_there_and_match_transformers(case, model_dir, tmp_path, captured_logits,
                                                                      report_logit_diff):
    """On a GPU the integers dequantize to the CPU's values bit for bit, and the engine in fp32 gives transformers'
    tokens and logits on the weights they stand for."""
    kind, _, quantization = INT_QUANTIZED[case]
    d = int_quantized_copy(model_dir(kind), tmp_path / "q", tmp_path / "reference", quantization)
    tensors = load_file(d / "model.safetensors")
    parts = [tensors[f"model.layers.0.mlp.down_proj.{p}"] for p in ("qweight", "scales", "qzeros")]
    dequantize = (lambda q, s, z: dequantize_gptq(q, s, z, None, 4, 32, True, torch.float32)) \
        if quantization["quant_method"] == "gptq" else (lambda q, s, z: dequantize_awq(q, s, z, 32, torch.float32))
    assert torch.equal(dequantize(*(p.cuda() for p in parts)).cpu(), dequantize(*parts))
    with LLM(str(d), device="cuda", dtype="float32", max_model_len=128, num_kvcache_blocks=64) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, hf_greedy(tmp_path / "reference", PROMPTS, MAX_TOKENS), captured_logits)
    report_logit_diff(f"{case}, CUDA fp32", worst)
    assert worst < CUDA_FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
