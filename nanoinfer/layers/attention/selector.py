"""Chooses the device and the attention backend once at start-up, and the KV block sizes each backend accepts."""
import importlib.util
import logging
import os

import torch

from nanoinfer.utils.dist import tp_rank

logger = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "cpu", "flash", "triton")
# flash-attn 2 refuses a paged KV cache whose page is not a multiple of 256 tokens (flash_api.cpp, both
# mha_varlen_fwd and mha_fwd_kvcache: "Paged KV cache block size must be divisible by 256").
FLASH_BLOCK_MULTIPLE = 256
DEFAULT_BLOCK_SIZE = {"cpu": 16, "flash": 256, "triton": 16}
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
# The Triton kernels keep a [rows, head_dim] fp32 accumulator in registers: from 257 on, in the wide tiles (fewer
# rows and keys, kernels/triton_attention.py's wide_config), compiled and checked for sm_90 up to Gemma 4's 512.
TRITON_MAX_HEAD_DIM = 512
# MLA's latent cache (values = the keys' first kv_lora_rank entries) through Triton's wide tiles, compiled and
# checked for DeepSeek's 512 + 64.
TRITON_MAX_LATENT_DIM, TRITON_MAX_LATENT_ROPE_DIM = 512, 64


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' is CUDA when visible, else CPU; a bare 'cuda' is this process's GPU (LOCAL_RANK, else its TP rank)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'") from e
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"unsupported device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch {torch.__version__} sees no CUDA device")
    index = resolved.index
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", tp_rank())) % torch.cuda.device_count()
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def check_tensor_parallel_devices(requested: str | torch.device, device: torch.device,
                                  tensor_parallel_size: int) -> None:
    """On CUDA each tensor-parallel rank on this machine (LOCAL_WORLD_SIZE of them under torchrun, else all) needs
    a GPU of its own: two ranks sharing one would each size their cache for the whole GPU."""
    if device.type != "cuda" or tensor_parallel_size == 1:
        return
    if requested != "auto" and torch.device(requested).index is not None:
        raise ValueError(f"device={str(requested)!r} would put all {tensor_parallel_size} tensor-parallel ranks on one "
                         f"GPU; pass device='cuda' (rank i takes GPU i)")
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size))
    if ranks_here > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {ranks_here} GPUs on this machine, but "
                         f"{torch.cuda.device_count()} CUDA device(s) are visible; lower it, or pass device='cpu'")


def flash_attn_available() -> bool:
    """flash-attn and triton (the `cuda` extra) import. Called only on CUDA machines."""
    try:
        import flash_attn  # noqa: F401
        import triton  # noqa: F401
    except (ImportError, OSError):  # OSError: a build whose CUDA libraries do not load
        return False
    return True


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(requested: str, device: torch.device, *, latent_cache: bool = False,
                   attention_sinks: bool = False, chunked_attention: bool = False, head_dim: int = 0,
                   pytorch_only: tuple[str, str, str] | None = None) -> str:
    """'flash' on CUDA with flash-attn installed, else 'triton' (paged Triton kernels; triton ships with CUDA
    builds of torch); 'cpu', the PyTorch backend, on the CPU or when asked for. 'triton' on a CPU device runs
    in Triton's interpreter, which only TRITON_INTERPRET=1 turns on (tests prove the kernels' logic that way).
    'auto' never picks flash for a latent cache (MLA; see check_backend_limits) nor for attention sinks (GPT-OSS) or
    chunked local attention (Llama 4), which flash-attn 2 lacks: asking for 'flash' with either is an error.
    head_dim: the widest layer's (not MLA's); 'auto' takes the PyTorch backend where it is wider than flash and Triton
    take (Gemma 4's full layers: 512), an explicit 'flash' or 'triton' is refused for it by check_backend_limits.
    pytorch_only: (architecture, its attention's name, what it does) where the PyTorch backend alone runs that
    attention (DeepSeek's and MiniMax-M3's sparse attention, Inkling's relative logits:
    registry.pytorch_only_attention): 'auto' takes it (saying so on CUDA), 'flash' and 'triton' are refused."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention_backend {requested!r}; use one of {list(BACKEND_CHOICES)}")
    if pytorch_only is not None:
        return _pytorch_only_backend(requested, device, *pytorch_only)
    if requested == "flash" and attention_sinks:
        raise ValueError("attention_backend='flash' cannot run this model: its attention has sinks (a learned logit "
                         "per head in every softmax), which flash-attn 2 lacks; use 'triton' (its default on CUDA) "
                         "or 'cpu'")
    if requested == "flash" and chunked_attention:
        raise ValueError("attention_backend='flash' cannot run this model: its attention is chunked (a query sees only "
                         "the keys of its own attention_chunk_size chunk), which flash-attn 2 lacks; use 'triton' (its "
                         "default on CUDA) or 'cpu'")
    if requested == "triton":
        _check_triton(device)
        return "triton"
    if device.type != "cuda":
        if requested == "flash":
            raise ValueError(f"attention_backend='flash' needs a CUDA device, but the device is {device}")
        return "cpu"
    if requested == "cpu":
        return "cpu"
    wide = not latent_cache and head_dim > FLASH_MAX_HEAD_DIM
    if flash_attn_available() and (requested == "flash"
                                   or not (latent_cache or attention_sinks or chunked_attention or wide)):
        return "flash"
    if requested == "flash":
        raise ValueError("attention_backend='flash' needs flash-attn and triton: pip install 'nanoinfer[cuda]'")
    if not latent_cache and head_dim > TRITON_MAX_HEAD_DIM:
        logger.info("attention: the model's heads of %d are wider than the flash and triton backends take (triton: "
                    "%d at most); using the PyTorch backend (attention_backend='cpu')", head_dim, TRITON_MAX_HEAD_DIM)
        return "cpu"
    _check_triton(device)
    return "triton"


def _pytorch_only_backend(requested: str, device: torch.device, architecture: str, name: str, what: str) -> str:
    if requested in ("flash", "triton"):
        raise ValueError(f"attention_backend={requested!r} cannot run {architecture}: only the PyTorch backend runs "
                         f"its {name} ({what}); use attention_backend='cpu' (what 'auto' takes for it)")
    if device.type == "cuda" and requested == "auto":
        logger.info("attention: only the PyTorch backend runs %s's %s; using it (attention_backend='cpu')",
                    architecture, name)
    return "cpu"


def _check_triton(device: torch.device) -> None:
    if not triton_available():
        raise ValueError("the triton attention backend needs triton: pip install triton (Linux CUDA builds of "
                         "torch ship it), or pass attention_backend='cpu' (PyTorch SDPA, slower)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend='triton' on the {device} device runs only in Triton's interpreter, "
                         "which needs TRITON_INTERPRET=1 in the environment before triton is imported (it is "
                         "slow: for tests); use attention_backend='cpu' on the CPU")


def check_backend_limits(backend: str, block_size: int, dtype: torch.dtype, head_dim: int,
                         latent_dim: int | None = None) -> None:
    """head_dim: the cache's; latent_dim: MLA's latent, the values' width (K's prefix), or None."""
    if latent_dim is not None:
        return _check_latent_limits(backend, head_dim, latent_dim)
    if backend == "triton" and head_dim > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"the triton attention backend supports head_dim <= {TRITON_MAX_HEAD_DIM}, the model has "
                         f"{head_dim}; use attention_backend='cpu'")
    if backend != "flash":
        return
    if block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(f"kvcache_block_size={block_size} is not valid for the flash backend: flash-attn's paged KV "
                         f"cache needs a multiple of {FLASH_BLOCK_MULTIPLE} (the default there is "
                         f"{DEFAULT_BLOCK_SIZE['flash']}); or use attention_backend='cpu'")
    if dtype not in FLASH_DTYPES:
        raise ValueError(f"flash-attn computes in float16 or bfloat16 only, got dtype {dtype}; pass "
                         f"dtype='bfloat16' (or 'float16'), or attention_backend='cpu'")
    if head_dim > FLASH_MAX_HEAD_DIM:
        raise ValueError(f"flash-attn supports head_dim <= {FLASH_MAX_HEAD_DIM}, the model has {head_dim}; "
                         f"use attention_backend='cpu'")


def _check_latent_limits(backend: str, head_dim: int, latent_dim: int) -> None:
    if backend == "flash":
        # flash-attn 2 takes K and V of one head size up to 256; the latent cache's keys are 576 wide for DeepSeek-V3
        # and its values their first 512.
        raise ValueError("flash-attn cannot run MLA's latent KV cache (values a prefix of the keys, "
                         f"{latent_dim} of {head_dim}); use attention_backend='triton' (the default for this model "
                         "on CUDA) or 'cpu'")
    rope_dim = head_dim - latent_dim
    if backend == "triton" and (latent_dim > TRITON_MAX_LATENT_DIM or rope_dim > TRITON_MAX_LATENT_ROPE_DIM):
        raise ValueError(f"the triton attention backend runs MLA with kv_lora_rank <= {TRITON_MAX_LATENT_DIM} and "
                         f"qk_rope_head_dim <= {TRITON_MAX_LATENT_ROPE_DIM}, the model has {latent_dim} and "
                         f"{rope_dim}; use attention_backend='cpu'")
