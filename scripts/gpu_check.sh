#!/usr/bin/env bash
# The GPU machine's check: build the extension for Hopper, run the cuda-marked tests and
# the whole suite, then the benchmark; logs under $OUT (or ./gpu_out), a short table last.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m lightning_cafin.kernels.loader --build > "$OUT/build.log" 2>&1; echo "build rc=$?" | tee -a "$OUT/gpu.txt"
tail -3 "$OUT/build.log"
python3 -m pytest -q -m cuda -p no:cacheprovider ${CUDA_K:+-k "$CUDA_K"} ${CUDA_TESTS:-tests} > "$OUT/cuda_tests.log" 2>&1; echo "cuda tests rc=$?"
tail -15 "$OUT/cuda_tests.log"
if [ "${FULL:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m "not cuda" tests > "$OUT/cpu_tests.log" 2>&1; echo "other tests rc=$?"
  tail -4 "$OUT/cpu_tests.log"
fi
if [ "${BENCH:-1}" = 1 ] && [ -d lightning_cafin/bench ]; then
  python3 -m lightning_cafin.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi
