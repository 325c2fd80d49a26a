"""Runs tests/triton_interpreted.py and tests/triton_attention_interpreted.py in a pytest process of their own
with TRITON_INTERPRET=1: the variable must be set before triton defines a kernel, so they cannot share this
process with code that imported triton normally."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter(report_logit_diff):
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI"):
            pytest.fail("triton is not installed; `make test` installs it (see the Makefile)")
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = ["tests/triton_interpreted.py", "tests/triton_attention_interpreted.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1200)
    summary = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, summary
    counts = re.search(r"(\d+) passed", r.stdout)
    assert counts and int(counts.group(1)) >= 87, summary
    # A case may skip only where the installed transformers cannot be its reference (conftest.py's model_dir).
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", r.stdout, re.M)
    assert all(reason.endswith("(the reference)") for reason in skips), summary
    for name, value in re.findall(r"^(.*(?:flash|triton) backend.*): ([0-9.e+-]+)$", r.stdout, re.M):
        report_logit_diff(name, float(value))
