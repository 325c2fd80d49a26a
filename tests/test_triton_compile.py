"""The Triton kernels compiled ahead of time for an H100 (sm_90) by Triton's own compiler and ptxas, which need no
GPU: what the interpreter cannot show — that every variant compiles, that the attention kernel's K/V loads are
pipelined (cp.async) and that the 16-bit kernels keep to registers (no spills)."""
import importlib.util
import os
import subprocess
import tempfile

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels: run without TRITON_INTERPRET", allow_module_level=True)

import triton  # noqa: E402

# Triton's compiler API (ASTSource's attrs, GPUTarget) changes between releases: these checks are written for the
# triton that `make test` installs and the one an H100 machine's torch 2.11 pins; elsewhere
# tests/test_triton_attention_cuda.py runs the real kernels instead.
if triton.__version__ not in ("3.6.0", "3.7.1"):
    pytest.skip(f"compile checks written for triton 3.6.0 and 3.7.1, found {triton.__version__}",
                allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanoinfer.kernels import triton_attention as ta  # noqa: E402
from nanoinfer.kernels import triton_kvcache, triton_layers, triton_sampling  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "block_tables_ptr",
            "context_lens_ptr", "cu_seqlens_q_ptr", "cu_seqlens_k_ptr")
STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")


def compile_attention(dtype: str, group: int, head_dim: int, config: ta.TileConfig, tail_dim: int = 0,
                      kv_split: int = 1, **flags: bool):
    """The kernel as a launch would specialize it: 16-byte aligned pointers, strides divisible by 16. group: a
    program's query heads, kv_split: programs per KV head. tail_dim: q/k dims past the values' head_dim (MLA's rope
    part)."""
    fn = ta._attention_kernel
    split = flags["SPLIT"]
    types = {name: "*i32" for name in POINTERS[7:]}
    types.update({name: f"*{dtype}" for name in POINTERS[:4]})
    types.update({name: "*fp32" if split else f"*{dtype}" for name in POINTERS[4:7]})
    types.update({name: "i32" for name in ("window", "chunk", "num_seqs", "num_heads", "num_segments", "stride_bt")})
    types.update({name: "i32" for name in STRIDES}, qk_scale="fp32", cap_scale="fp32")
    flags.setdefault("SOFTCAP", False)
    flags.setdefault("HAS_SINKS", False)
    flags.setdefault("ALIBI", False)
    flags.setdefault("HAS_CHUNK", False)
    types["sinks_ptr"] = f"*{dtype}" if flags["HAS_SINKS"] else "*i32"  # without sinks: context_lens, never read
    types["alibi_ptr"] = "*fp32" if flags["ALIBI"] else "*i32"  # the slopes, fp32 whatever the model's dtype
    constants = dict(GROUP=group, KV_SPLIT=kv_split, HEAD_DIM=head_dim, BLOCK_D=ta._block_d(head_dim),
                     TAIL_DIM=tail_dim, BLOCK_T=ta._block_d(tail_dim),
                     BLOCK_M=config.block_m, BLOCK_Q=config.block_m // group, BLOCK_N=config.block_n,
                     KV_BLOCK_SIZE=16, UPCAST=False, PRECISION="tf32x3" if dtype == "fp32" else "tf32", **flags)
    return compile_kernel(fn, types, constants, aligned=(*POINTERS, *STRIDES), num_warps=config.num_warps,
                          num_stages=config.num_stages)


def compile_kernel(fn, types: dict[str, str], constants: dict, aligned: tuple[str, ...], **options: int):
    """`fn` compiled for sm_90 with the arguments in `aligned` marked divisible by 16, as a launch marks them."""
    types = {**types, **{name: "constexpr" for name in constants}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, {name: types[name] for name in fn.arg_names}, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=H100, options=options)


def stack_bytes(cubin: bytes) -> int:
    """Per-thread stack of the compiled kernel: register spills land there."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    return int(usage.split("STACK:")[1].split()[0])


DECODE = dict(DECODE=True, PAGED=True, CAUSAL=True)
CASES = [  # (dtype, group, head_dim, config, flags): Qwen3-0.6B's shapes first, then odd ones
    ("bf16", 2, 128, ta.decode_config(2, 128, 2), dict(DECODE, HAS_WINDOW=False, SPLIT=False)),
    ("bf16", 2, 128, ta.decode_config(2, 128, 2), dict(DECODE, HAS_WINDOW=True, SPLIT=True)),
    ("bf16", 2, 128, ta.prefill_config(2, 128, 2, 1024),
     dict(DECODE=False, PAGED=False, CAUSAL=True, HAS_WINDOW=False, SPLIT=False)),
    ("bf16", 2, 128, ta.prefill_config(2, 128, 2, 1024),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=True, SPLIT=False)),
    ("fp16", 3, 80, ta.prefill_config(3, 80, 2, 7),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=False, SPLIT=False)),
    ("bf16", 1, 256, ta.prefill_config(1, 256, 2, 1024),
     dict(DECODE=False, PAGED=False, CAUSAL=False, HAS_WINDOW=False, SPLIT=False)),
    ("fp32", 2, 128, ta.decode_config(2, 128, 4), dict(DECODE, HAS_WINDOW=False, SPLIT=True)),
    # Gemma 2's softcapped scores (its 9B's shapes: 2 query heads per KV head, head_dim 256).
    ("bf16", 2, 256, ta.decode_config(2, 256, 2), dict(DECODE, HAS_WINDOW=True, SPLIT=True, SOFTCAP=True)),
    ("bf16", 2, 256, ta.prefill_config(2, 256, 2, 1024),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=True, SPLIT=False, SOFTCAP=True)),
    # GPT-OSS's attention sinks (its shapes: 8 query heads per KV head, head_dim 64; windowed and full layers).
    ("bf16", 8, 64, ta.decode_config(8, 64, 2), dict(DECODE, HAS_WINDOW=True, SPLIT=True, HAS_SINKS=True)),
    ("bf16", 8, 64, ta.prefill_config(8, 64, 2, 1024),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=False, SPLIT=False, HAS_SINKS=True)),
    # ALiBi (BLOOM-7B1's shapes: 32 heads of 128, one per KV head; MPT-7B's are the same).
    ("bf16", 1, 128, ta.decode_config(1, 128, 2), dict(DECODE, HAS_WINDOW=False, SPLIT=True, ALIBI=True)),
    ("bf16", 1, 128, ta.prefill_config(1, 128, 2, 1024),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=False, SPLIT=False, ALIBI=True)),
    ("bf16", 1, 128, ta.prefill_config(1, 128, 2, 1024),
     dict(DECODE=False, PAGED=False, CAUSAL=True, HAS_WINDOW=False, SPLIT=False, ALIBI=True)),
    # Llama 4 Scout's chunked rope layers (40 query heads of 128 over 8 KV heads: 5 per KV head).
    ("bf16", 5, 128, ta.decode_config(5, 128, 2), dict(DECODE, HAS_WINDOW=False, SPLIT=True, HAS_CHUNK=True)),
    ("bf16", 5, 128, ta.prefill_config(5, 128, 2, 1024),
     dict(DECODE=False, PAGED=True, CAUSAL=True, HAS_WINDOW=False, SPLIT=False, HAS_CHUNK=True)),
    ("bf16", 5, 128, ta.prefill_config(5, 128, 2, 1024),
     dict(DECODE=False, PAGED=False, CAUSAL=True, HAS_WINDOW=False, SPLIT=False, HAS_CHUNK=True)),
    # ModernBERT-base's local layers: the encoder pass, non-causal with a window on both sides (12 heads of 64).
    ("bf16", 1, 64, ta.prefill_config(1, 64, 2, 1024),
     dict(DECODE=False, PAGED=False, CAUSAL=False, HAS_WINDOW=True, SPLIT=False)),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, group, head_dim, config, flags", CASES,
                         ids=[f"{c[0]}-group{c[1]}-d{c[2]}-{'decode' if c[4]['DECODE'] else 'prefill'}"
                              f"{'-softcap' * c[4].get('SOFTCAP', False)}{'-sinks' * c[4].get('HAS_SINKS', False)}"
                              f"{'-alibi' * c[4].get('ALIBI', False)}{'-chunk' * c[4].get('HAS_CHUNK', False)}"
                              f"{'-paged' * c[4]['PAGED']}" for c in CASES])
def test_attention_kernel_compiles_for_sm90(dtype, group, head_dim, config, flags):
    kernel = compile_attention(dtype, group, head_dim, config, **flags)
    assert "cp.async" in kernel.asm["ptx"]  # K/V tiles are loaded asynchronously, num_stages deep
    if dtype != "fp32":  # fp32 (tf32x3) is there for exactness, not speed
        assert stack_bytes(kernel.asm["cubin"]) == 0


H100_SHARED_MEMORY = 227 << 10  # per block, opt-in: more and the launch raises OutOfResources


# (dtype, query heads per KV head, head dim): fp32 tiles 256 wide once took 256 KB, at 64 rows, and a group of over 32
# heads (multi-query attention) asked for 64 rows again; the largest groups of 16-bit tiles up to 128 rows.
FIT_CASES = [("fp32", 4, 256), ("fp32", 4, 160), ("bf16", 4, 256), ("fp32", 4, 384), ("fp32", 64, 256),
             ("fp32", 40, 160), ("fp32", 128, 128), ("bf16", 64, 256), ("bf16", 128, 128)]


@pytest.mark.slow
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("dtype, group, head_dim", FIT_CASES, ids=str)
def test_tiles_fit_the_h100_shared_memory(dtype, group, head_dim, decode):
    """Every head dim up to the backend's limit, in every dtype and with large groups, launches on an H100 with the
    tiles the backend picks (a group larger than their rows split over programs)."""
    itemsize = 4 if dtype == "fp32" else 2
    config = ta.decode_config(group, head_dim, itemsize) if decode else ta.prefill_config(group, head_dim, itemsize,
                                                                                           1024)
    heads = ta.heads_per_program(group, config.block_m)
    kernel = compile_attention(dtype, heads, head_dim, config, kv_split=group // heads, DECODE=decode, PAGED=True,
                               CAUSAL=True, HAS_WINDOW=True, SPLIT=decode)
    assert kernel.metadata.shared <= H100_SHARED_MEMORY, (config, kernel.metadata.shared)


MLA_CASES = [  # DeepSeek's latent cache: (dtype, decode, paged)
    ("bf16", True, True), ("bf16", False, True), ("bf16", False, False), ("fp16", False, True), ("fp32", True, True),
    ("fp32", False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, decode, paged", MLA_CASES,
                         ids=[f"{c[0]}-{'decode' if c[1] else 'prefill'}{'-paged' * c[2]}" for c in MLA_CASES])
def test_latent_cache_tiles_compile_for_sm90(dtype, decode, paged):
    """DeepSeek-V3's MLA on one rank: 128 query heads over the one latent KV head, values 512 wide (kv_lora_rank),
    keys 64 more (qk_rope_head_dim): the tiles the backend picks (16 or 32 heads per program) compile with
    pipelined K/V loads, fit an H100's shared memory, and in 16 bits keep to registers."""
    itemsize = 4 if dtype == "fp32" else 2
    config = ta.decode_config(128, 512, itemsize) if decode else ta.prefill_config(128, 512, itemsize, 1024)
    heads = ta.heads_per_program(128, config.block_m)
    kernel = compile_attention(dtype, heads, 512, config, tail_dim=64, kv_split=128 // heads, DECODE=decode,
                               PAGED=paged, CAUSAL=True, HAS_WINDOW=False, SPLIT=decode)
    assert "cp.async" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= H100_SHARED_MEMORY, (config, kernel.metadata.shared)
    if dtype != "fp32":
        assert stack_bytes(kernel.asm["cubin"]) == 0


WIDE_CASES = [  # heads of 512 (Gemma 4's full layers): (dtype, group, decode, paged)
    ("bf16", 8, True, True), ("bf16", 8, False, True), ("bf16", 8, False, False), ("fp16", 2, True, True),
    ("fp16", 2, False, True), ("bf16", 32, True, True), ("fp32", 8, True, True), ("fp32", 8, False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, group, decode, paged", WIDE_CASES,
                         ids=[f"{c[0]}-group{c[1]}-{'decode' if c[2] else 'prefill'}{'-paged' * c[3]}"
                              for c in WIDE_CASES])
def test_wide_head_tiles_compile_for_sm90(dtype, group, decode, paged):
    """Heads of 512 without a key tail take MLA's wide tiles (a group larger than their rows split over programs):
    they compile with pipelined K/V loads, fit an H100's shared memory, and in 16 bits keep to registers."""
    itemsize = 4 if dtype == "fp32" else 2
    config = ta.decode_config(group, 512, itemsize) if decode else ta.prefill_config(group, 512, itemsize, 1024)
    heads = ta.heads_per_program(group, config.block_m)
    kernel = compile_attention(dtype, heads, 512, config, kv_split=group // heads, DECODE=decode, PAGED=paged,
                               CAUSAL=True, HAS_WINDOW=False, SPLIT=decode)
    assert "cp.async" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= H100_SHARED_MEMORY, (config, kernel.metadata.shared)
    if dtype != "fp32":
        assert stack_bytes(kernel.asm["cubin"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [80, 512])  # 512: MLA's latent values, Gemma 4's full heads
def test_reduce_kernel_compiles_for_sm90(head_dim):
    kernel = compile_kernel(ta._reduce_kernel, dict(out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                                                    part_sum_ptr="*fp32", num_segments="i32", num_heads="i32"),
                            dict(HEAD_DIM=head_dim, BLOCK_D=ta._block_d(head_dim), BLOCK_S=ta.MAX_SEGMENTS),
                            aligned=(), num_warps=4)
    assert "ld.global" in kernel.asm["ptx"] and stack_bytes(kernel.asm["cubin"]) == 0


# The layer kernels as the CUDA engine launches them (Qwen3-0.6B's sizes: hidden 1024, intermediate 3072,
# 8 KV heads x 128, vocabulary 151,936), in each activation dtype.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_layer_kernels_compile_for_sm90(dtype):
    kernels = [  # RMSNorm with a weight of the activations' dtype, and Gemma's fp32 one
        compile_kernel(triton_layers._rms_norm_kernel,
                       dict(x_ptr=f"*{dtype}", residual_ptr=f"*{dtype}", weight_ptr=f"*{weight_dtype}",
                            out_ptr=f"*{dtype}", residual_out_ptr=f"*{dtype}", x_stride="i32", residual_stride="i32",
                            eps="fp32"),
                       dict(N=1024, BLOCK=1024, HAS_RESIDUAL=True, FP32_WEIGHT=weight_dtype != dtype),
                       aligned=("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr", "x_stride",
                                "residual_stride"), num_warps=4)
        for weight_dtype in dict.fromkeys((dtype, "fp32"))
    ] + [
        compile_kernel(triton_layers._silu_and_mul_kernel, dict(x_ptr=f"*{dtype}", out_ptr=f"*{dtype}", x_stride="i32"),
                       dict(N=3072, BLOCK=1024), aligned=("x_ptr", "out_ptr", "x_stride"), num_warps=4),
        compile_kernel(triton_kvcache._store_kvcache_kernel,
                       dict(k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", k_cache_ptr=f"*{dtype}", v_cache_ptr=f"*{dtype}",
                            slot_mapping_ptr="*i64", k_stride="i32", v_stride="i32"),
                       dict(D=1024, BLOCK_D=1024, HAS_V=True),
                       aligned=("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "slot_mapping_ptr", "k_stride",
                                "v_stride"), num_warps=4),
        # q of Qwen3-0.6B's attention (16 heads x 128) with its q norm, out of the fused qkv rows, rounded as
        # transformers' Qwen3 rounds in 16-bit models.
        compile_kernel(triton_layers._rotary_kernel,
                       dict(x_ptr=f"*{dtype}", positions_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
                            weight_ptr=f"*{dtype}", out_ptr=f"*{dtype}", stride_t="i32", stride_h="i32",
                            num_heads="i32", eps="fp32"),
                       dict(HEAD_DIM=128, HALF=64, TAIL=0, BLOCK_H=16, BLOCK_HALF=64, BLOCK_TAIL=1, HAS_NORM=True,
                            IN_DTYPE=dtype != "fp32"),
                       aligned=("x_ptr", "positions_ptr", "cos_ptr", "sin_ptr", "weight_ptr", "out_ptr", "stride_t",
                                "stride_h", "num_heads"), num_warps=4, enable_fp_fusion=False),
    ]
    for kernel in kernels:
        assert "st.global" in kernel.asm["ptx"] and stack_bytes(kernel.asm["cubin"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("scale", [True, False])
def test_sampling_kernel_compiles_for_sm90(scale):
    pointers = dict(logits_ptr="*fp32", temperatures_ptr="*fp32", keys_ptr="*i64", best_ptr="*fp32",
                    best_idx_ptr="*i32")
    kernel = compile_kernel(triton_sampling._gumbel_max_kernel, dict(pointers, vocab="i32", stride_row="i32"),
                            dict(SCALE=scale, BLOCK=triton_sampling.BLOCK),
                            aligned=(*pointers, "vocab", "stride_row"), num_warps=triton_sampling.NUM_WARPS)
    ptx = kernel.asm["ptx"]
    # The logits load vectorized; the temperature division IEEE-rounded (as torch's), not Triton's approximate one.
    assert "ld.global.v4" in ptx and stack_bytes(kernel.asm["cubin"]) == 0
    assert ("div.rn.f32" in ptx) == scale and "div.full.f32" not in ptx


def test_prefill_tile_lengths_reach_every_tile_shape():
    """Start-up compiles prefill with these numbers of new tokens (ModelRunner._compile_kernels): for every group,
    head width and dtype, each step length up to 300 gets the tile shape of one of them at most as long."""
    for group in range(1, 70):
        lengths = ta.prefill_tile_lengths(group)
        for head_dim, itemsize in [(128, 2), (80, 2), (256, 2), (64, 4), (256, 4), (512, 2)]:
            for new in range(2, 300):
                config = ta.prefill_config(group, head_dim, itemsize, new)
                assert any(ta.prefill_config(group, head_dim, itemsize, n) == config for n in lengths if n <= new), (
                    group, head_dim, itemsize, new)
