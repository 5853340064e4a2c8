#!/usr/bin/env bash
# The GPU run, in one script: on a CUDA machine without internet (torch, triton, transformers and
# pybind11 preinstalled) it installs specengine without dependencies, runs the GPU tests (Triton
# compiled, not interpreted), the verify-kernel benchmark and the step-cost benchmark (the shipped
# pair's costs, alpha and time per round by phase on the GPU, and a ~1B memory-bound target's
# costs fed into Theorem 3.8), the CUDA-graph benchmark (draft step eager vs replayed, end to end
# eager loop vs specengine eager vs graphs), and writes logs, CSVs and JSON to $OUT.
# Budget: under 8 minutes (the timeouts add up to 460 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
status=0

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  echo "install failed:"; tail -20 "$OUT/install.log"; exit 1
fi

# GPU tests: the Triton kernel compiled against the reference (exact, statistical, invariants,
# no recompilation), and greedy decoding on CUDA equal to CPU decoding.
timeout 170 python -m pytest -q -rs tests/test_verify_kernels.py tests/test_engine_greedy.py tests/test_graphs.py \
  --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 110 python bench/bench_verify.py --out "$OUT/verify-gpu.csv" 2>&1 | tee "$OUT/bench-verify.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 80 python bench/bench_costs.py --device cuda --out "$OUT/costs-gpu.json" 2>&1 | tee "$OUT/bench-costs.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 100 python bench/bench_graphs.py --device cuda --out "$OUT/graphs-gpu.json" 2>&1 | tee "$OUT/bench-graphs.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "results in $OUT (status $status)"
exit $status
