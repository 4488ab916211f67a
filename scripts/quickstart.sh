#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: a short real training run of AdaFisher
# on Fashion-MNIST with TensorBoard logs.  Safe to run again (installs are skipped when present).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${CAFIN_DATA_DIR:-}" ]; then
    echo "== installing Debian's dataset-fashion-mnist (real data, 70,000 images)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

echo "== installing lightning-cafin and its dependencies"
python3 -m pip install -q -e .

echo "== training (AdaFisher + CAFINCallback, small CNN, Fashion-MNIST)"
LOGDIR="${LOGDIR:-lightning_logs}"
python3 examples/lightning_module.py --max-steps "${MAX_STEPS:-600}" --logdir "$LOGDIR" "$@"
