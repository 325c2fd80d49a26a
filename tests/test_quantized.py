"""Quantized checkpoints dequantized on load: block-wise FP8 (Qwen3, DeepSeek-V3; TP 1 and 2) and GPT-OSS's MXFP4
against transformers loading the same files with `dequantize=True`, the edge tiles of FP8 blocks, and the
checkpoints and settings refused by name (other quant methods, a missing or misshapen scale)."""
import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import check_against_hf, hf_greedy, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.utils.quantization import dequantize_fp8, dequantized_weights, quant_scheme

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
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    refs = hf_dequantized_greedy(d, monkeypatch)
    worst = check_against_hf(outputs, refs, captured_logits)
    report_logit_diff(f"{kind} FP8, tensor parallel {tp}", worst)
    assert worst < LOGIT_ATOL, f"max |logit diff| {worst:.2e}"
    # The rounding to FP8 shows in the logits: the unquantized weights would not have matched.
    unquantized = hf_greedy(model_dir(kind), PROMPTS[:1], MAX_TOKENS)[0]["logits"]
    assert (unquantized - refs[0]["logits"]).abs().max() > 100 * LOGIT_ATOL


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
    out = dict(dequantized_weights(weights, quant_scheme(config), torch.device("meta"), torch.bfloat16))
    assert out.keys() == {"a.weight", "norm.weight"} and out["norm.weight"] is norm
    assert out["a.weight"].device.type == "meta" and out["a.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method='awq'"),
    ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, r"quant_method='compressed-tensors'"),
    ({"quant_method": "mxfp4"}, r"quant_method='mxfp4'.* not supported for Qwen3ForCausalLM"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
], ids=["awq", "gptq", "bitsandbytes", "compressed-tensors", "mxfp4-not-gpt-oss", "fp8-static", "fp8-bad-block"])
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
     r"quantized checkpoint tensor 'model.layers.1.mlp.up_proj.weight' in .*model.safetensors has no scale "
     r"'model.layers.1.mlp.up_proj.weight_scale_inv'"),
    ("model.layers.1.mlp.up_proj.weight", (32, 16),
     r"'model.layers.1.mlp.up_proj.weight_scale_inv' in .*model.safetensors scales no quantized tensor"),
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
                                         rf"has no scale '{scales}'"):
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
