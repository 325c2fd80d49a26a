"""A pytest plugin that runs the CPU suite as a GPU machine would see it, on a CPU: torch says one CUDA device is
visible, and any CUDA initialisation fails the test that made it, with its stack logged. A CPU test that builds an
engine without device="cpu" (which would then run on CUDA, in bf16) or otherwise touches the GPU shows up here,
without a GPU. Not part of the suite (it would double CI's time); run by hand after adding CPU tests:

    PYTHONPATH=scripts python -m pytest -q -p as_gpu_machine -m "not cuda"

Subprocesses (tensor-parallel workers, the interpreted-Triton runs) see the real, CPU-only torch."""
import os
import tempfile
import traceback

import torch

# A stack is logged as well as raised: code that catches the error (a try around a capability query) would hide it.
LOG = os.environ.get("AS_GPU_MACHINE_LOG", os.path.join(tempfile.gettempdir(), "nanoinfer-cuda-init.log"))
_test = "<collection>"

# The CPU build has no CUDA runtime: claiming a device only changes what device="auto", dtype="auto" and the
# tests' own checks decide; whatever would then really start CUDA goes through torch.cuda._lazy_init.
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1


def _lazy_init() -> None:
    with open(LOG, "a") as f:
        f.write(f"== {_test}\n{''.join(traceback.format_stack(limit=12))}\n")
    raise RuntimeError(f"a CPU test initialised CUDA (as on a GPU machine): {_test}; the stack is in {LOG}")


torch.cuda._lazy_init = _lazy_init


def pytest_runtest_setup(item) -> None:
    global _test
    _test = item.nodeid
