#!/usr/bin/env bash
# The GPU machine's evidence run: build the extension, run the quick start through the cafin CLI
# (the fused step on a GPU), then the convergence study; logs and results under $OUT.
# Carry: data (the Fashion-MNIST .gz files in data/fashion-mnist) and vendor (scripts/vendor_wheels.sh).
# Env: STUDY_ARGS (e.g. "--epochs 5"), QUICKSTART=0 to skip the quick start.
# It leaves 6 files under $OUT (that machine returns at most 8): do not chain gpu_check.sh in the same call.
source "$(dirname "$0")/gpu_env.sh"
python3 -m lightning_cafin.kernels.loader --build > /tmp/build.log 2>&1 || { echo "build failed:"; tail -20 /tmp/build.log; }
if [ "${QUICKSTART:-1}" = 1 ]; then
  python3 -m lightning_cafin.cli fit --config configs/quickstart.yaml \
      --trainer.logger.init_args.save_dir=/tmp/lightning_logs --trainer.enable_progress_bar=false \
      > "$OUT/quickstart.log" 2>&1
  echo "quickstart rc=$?"; grep -E "backend|TensorBoard|Error" "$OUT/quickstart.log" | head -5
fi
python3 benchmarks/convergence.py --out "$OUT/convergence-h200" ${STUDY_ARGS:-} 2>&1 | tee "$OUT/study.log" | tail -12
