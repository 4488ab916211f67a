#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: the quick start config, a short real training
# run of AdaFisher on Fashion-MNIST with TensorBoard logs (the last lines say where they are).
# Works with a stock Debian/Ubuntu Python (PEP 668): everything goes into the project's .venv
# (PYTHON=... picks the interpreter that creates it).  Safe to run again: done steps are skipped.
# Extra arguments are LightningCLI overrides, e.g. --trainer.max_steps=200.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

ensure_fashion_mnist
ensure_venv
extras=""
if wants_cuda_build_wheels; then extras="cuda-build"; fi  # a GPU without nvcc: NVIDIA's compiler wheels
install_project "$extras"

echo "== training: cafin fit --config configs/quickstart.yaml (AdaFisher + CAFINCallback, small CNN, Fashion-MNIST)"
echo "   (with a GPU, the first run builds the CUDA extension first: a few minutes, once)"
"$VENV/bin/cafin" fit --config configs/quickstart.yaml "$@"
