"""example.py, the README's first run, on a model path (its default model comes from PyPI, which a GPU machine may not
reach): on the CPU, and on a CUDA GPU where one is visible, with the engine's defaults there (CUDA, bf16, the Triton
or flash backend, decode graphs)."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_example_answers_its_chat_prompts(device, qwen3_dir):
    """A model with fewer positions (512) than example.py once asked of every model (1024) too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the default device is the CPU even on a GPU machine
    proc = subprocess.run([sys.executable, "example.py", str(qwen3_dir)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("\n>>> ") == 3
