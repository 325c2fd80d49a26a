#!/usr/bin/env bash
# The CUDA tests' own logic on a CPU, for sessions without a GPU: copies the committed tree (HEAD) to a temporary
# directory, rewrites the tests' CUDA devices to the CPU (device="cuda", torch.device("cuda"), .cuda(), .to("cuda"),
# CUDA test parameters), lifts the skips that need a GPU and the sizing from free GPU memory, and runs the tests marked
# `cuda` there with the given pytest arguments. A test that builds wrong inputs, pairs prompts with the wrong
# parameters or holds the reference to too tight a bound fails here as it would on a GPU. Expected failures, to be read
# one by one: CUDA-only assertions (pinned buffers, graph runners, device types, memory figures), the triton backend,
# which needs the interpreter on a CPU, and exact bf16 comparisons of Triton kernels (the interpreter truncates fp32 to
# bf16 where a GPU rounds to nearest; tests/triton_interpreted.py patches that, this script does not). Not part of the
# suite.
#   scripts/rehearse_cuda_tests.sh [pytest args, e.g. tests/test_gpu.py -k "bf16 and cpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
git archive HEAD | tar -x -C "$DIR"
cd "$DIR"
sed -i -e 's/device="cuda"/device="cpu"/g' -e 's/torch\.device("cuda")/torch.device("cpu")/g' \
  -e 's/\.cuda()/.cpu()/g' -e 's/\.to("cuda")/.to("cpu")/g' -e 's/pytest\.param("cuda"/pytest.param("cpu"/g' \
  -e 's/not torch\.cuda\.is_available()/False/g' \
  -e 's/kwargs\["gpu_memory_utilization"\] = small_cache_utilization()/pass/' tests/test_*.py
# conftest skips every `cuda` test where torch sees no GPU: here it skips none.
sed -i 's/^    if torch\.cuda\.is_available():$/    if True:/' tests/conftest.py
PYTHONPATH=$DIR "$PY" -m pytest -q -p no:cacheprovider -rf -m cuda "${@:-tests}"
