#!/usr/bin/env bash
# Sets up a fresh machine and runs the main job: the quick start config, a short real training
# run of AdaFisher on Fashion-MNIST with TensorBoard logs (the last lines say where they are).  Safe to run again (installs are skipped when present).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${CAFIN_DATA_DIR:-}" ]; then
    echo "== installing Debian's dataset-fashion-mnist (real data, 70,000 images)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

echo "== installing lightning-cafin and its dependencies"
python3 -m pip install -q -e .

echo "== training: cafin fit --config configs/quickstart.yaml (AdaFisher + CAFINCallback, small CNN, Fashion-MNIST)"
# Extra arguments are LightningCLI overrides, e.g. --trainer.max_steps=200
python3 -m lightning_cafin.cli fit --config configs/quickstart.yaml "$@"
