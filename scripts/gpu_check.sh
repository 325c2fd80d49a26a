#!/usr/bin/env bash
# For a session with a CUDA GPU, in one device call from the repository root: the test suite with CUDA visible,
# then bench.py's CUDA benchmark (nano-vllm's workload, --compare-hf, --profile). Logs go under $OUT (default
# ./gpu-check); a short table ends the output. Each part has a time limit, so the whole fits one 10-minute call.
#   scripts/gpu_check.sh [all|tests|bench]      (two calls, one part each, give each part more time)
# Env: PYTHON (python3), TEST_TIMEOUT (240 s), BENCH_TIMEOUT (330 s), RUN_LIMIT (60 s per nanoinfer run in bench).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=${OUT:-$PWD/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NANOINFER_CACHE=${NANOINFER_CACHE:-/tmp/nanoinfer-cache}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__,
          "| cuda available:", torch.cuda.is_available())'
  $PY -c 'import triton; print("triton", triton.__version__)' || true
  $PY -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed"
} > "$OUT/env.txt" 2>&1

tests_rc=skipped
if [ "$PART" != bench ]; then
  per_test=()
  $PY -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=180)  # a hung test must not eat the call
  timeout -k 10 "${TEST_TIMEOUT:-240}" $PY -m pytest -q -rs -p no:cacheprovider "${per_test[@]}" > "$OUT/tests.log" 2>&1
  tests_rc=$?
fi

bench_rc=skipped
if [ "$PART" != tests ]; then
  timeout -k 10 "${BENCH_TIMEOUT:-330}" $PY bench.py --device cuda --compare-hf --profile \
    --time-limit "${RUN_LIMIT:-60}" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  bench_rc=$?
fi

echo "== environment"
cat "$OUT/env.txt"
if [ "$tests_rc" != skipped ]; then
  echo "== tests: exit $tests_rc (124: timed out) | $(tail -n 1 "$OUT/tests.log")"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -n 20
fi
if [ "$bench_rc" != skipped ]; then
  echo "== bench: exit $bench_rc (124: timed out)"
  grep -E '^(nano-vllm|greedy|decode|device-to|engine)' "$OUT/bench.log"
  grep -q '^| measure' "$OUT/bench.log" && sed -n '/^| measure/,$p' "$OUT/bench.log" || tail -n 15 "$OUT/bench.log"
fi
