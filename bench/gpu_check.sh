#!/usr/bin/env bash
# The GPU run, in one script: on a CUDA machine without internet (torch, triton, transformers and
# pybind11 preinstalled) it installs specengine without dependencies, then, each step under its
# own timeout and each writing its results as it goes (a step cut short keeps what it measured):
#   1. the kernel tests, compiled: the step kernels (norm, rotary, attention, SiLU) and the verify
#      kernel (exact, statistical, invariants, no recompilation);
#   2. the CUDA-graph and engine tests (graph replay token-identical to eager decoding);
#   3. bench_verify: the tiled Triton verify kernel, the previous one-program-per-row kernel and the
#      torch reference, eager and replayed from a CUDA graph, float32 and bfloat16 logits;
#   4. bench_step: launches per decoder layer and the replayed step against its weight-read floor,
#      Triton kernels, torch path and torch.compile, for the shipped draft, target and widened target;
#      bench_step_kernels: each step kernel against the torch ops it replaces;
#   5. bench_graphs on the memory-bound target (the shipped target embedded in a ~1B Llama, same
#      logits): eager PyTorch loop vs specengine eager vs CUDA graphs at batch 1, greedy, the
#      replayed step costs fed into Theorem 3.8, the host's share of a round;
#   6. bench_graphs on the shipped pair at batch 1 and 8, greedy and T=1 (the same rows, and the
#      draft step eager vs replayed);
#   7. bench_costs: the pair's eager step costs at batch 1 and 8, alpha, time per round by phase;
#   8. with two or more GPUs only: the shipped target split over two (NCCL, every round's tokens
#      compared across the ranks), greedy output against one GPU's. One GPU: skipped, and said so.
# Logs, CSVs and JSON are written to a work folder and packed, after every step, into
# $OUT/gpu-results.tar.gz (one file: the device tool returns at most 8). Budget: the steps'
# timeouts add up to 450 s (100 s more with two GPUs), the install's to 40 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
PACK="$OUT"
OUT="$(mktemp -d)/gpu-results"
mkdir -p "$OUT"
pack() { tar czf "$PACK/gpu-results.tar.gz" -C "$(dirname "$OUT")" gpu-results; }
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"  # the image's python3 holds torch
status=0

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Install: pip's editable install; if pip cannot (no setuptools backend there), build the C++
# ops in place and import from the tree.
if ! timeout 40 "$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  echo "pip install failed, building in place:"; tail -5 "$OUT/install.log"
  timeout 60 "$PY" setup.py build_ext --inplace >> "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; pack; exit 1; }
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import specengine, specengine._C" || { pack; exit 1; }
pack

step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log
  local name=$1 seconds=$2; shift 2
  echo "== $name (timeout ${seconds}s)"
  local t0=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
  pack
}

# The kernel tests first: on CUDA the model runs the Triton step kernels (falling back to the torch
# path, and saying so, if they fail to compile), so every later number depends on them.
step tests-kernels 80 "$PY" -m pytest -q -rs tests/test_step_kernels.py tests/test_verify_kernels.py \
  tests/test_sample_warped.py tests/test_csrc.py
step tests-graphs 40 "$PY" -m pytest -q -rs tests/test_graphs.py tests/test_device_rounds.py tests/test_engine_greedy.py \
  tests/test_widen.py tests/test_t5.py::test_t5_greedy_on_cuda_equals_cpu
step verify-bench 65 "$PY" bench/bench_verify.py --device cuda --out "$OUT/verify-gpu.csv"
step step-bench 70 "$PY" bench/bench_step.py --device cuda --out "$OUT/step-gpu.json"
step step-kernels-bench 30 "$PY" bench/bench_step_kernels.py --out "$OUT/step-kernels-gpu.json"
# Eager rounds are the slow rows (an eager step of the 1.0B target took 14-20 ms on the H200's host
# in 2026-11-29's runs): one eager gamma on the widened target, sizes chosen to fit the timeouts.
step graphs-widened 65 "$PY" bench/bench_graphs.py --device cuda --target widened --batches 1 --temperatures 0 \
  --gammas 2 3 4 --eager-gammas 3 --prompts 4 --new-tokens 32 --repeats 3 --out "$OUT/graphs-widened.json"
step graphs-shipped 75 "$PY" bench/bench_graphs.py --device cuda --target shipped --batches 1 8 \
  --gammas 1 2 3 4 --eager-gammas 2 --prompts 8 --new-tokens 32 --repeats 3 --out "$OUT/graphs-shipped.json"
step costs 25 "$PY" bench/bench_costs.py --device cuda --big-layers 0 --prompts 8 --out "$OUT/costs-gpu.json"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -gt 1 ]; then
  TP_ARGS=(generate --target specengine/pretrained/pycode-target --draft specengine/pretrained/pycode-draft
           --device cuda --prompt "def fibonacci(n):" --max-new-tokens 64 --temperature 0 --gamma 3 --json)
  step tp-single 40 "$PY" -m specengine "${TP_ARGS[@]}"
  step tp-split 60 env SPECENGINE_CHECK_RANKS=1 "$PY" -m torch.distributed.run --nproc-per-node 2 -m specengine \
    "${TP_ARGS[@]}" --tensor-parallel 2
  tokens() { grep '^{' "$OUT/$1.log" | "$PY" -c 'import json, sys; print(json.loads(sys.stdin.readline())["token_ids"])'; }
  if [ -n "$(tokens tp-single)" ] && [ "$(tokens tp-single)" = "$(tokens tp-split)" ]; then
    echo "== tp: the split target's greedy output equals one GPU's" | tee "$OUT/tp.log"
  else
    echo "== tp: the split target's greedy output differs from one GPU's" | tee "$OUT/tp.log"; status=1
  fi
else
  echo "== tp: skipped: $GPUS GPU here, tensor parallelism needs two" | tee "$OUT/tp.log"
fi
pack

echo "results in $PACK/gpu-results.tar.gz (status $status)"
exit $status
