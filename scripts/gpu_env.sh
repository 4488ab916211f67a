# Sourced by the GPU machine's scripts: the checkout as the working folder, logs under $OUT,
# Hopper as the build target, the carried data folder, the package importable without
# installing, and the carried CLI wheels (scripts/vendor_wheels.sh) installed if missing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export CAFIN_DATA_DIR="${CAFIN_DATA_DIR:-$PWD/data/fashion-mnist}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d vendor ] && ! python3 -c "import jsonargparse" 2>/dev/null; then
  # (logs outside $OUT: that machine returns at most 8 files)
  python3 -m pip install -q --no-index --find-links vendor "jsonargparse[signatures]" > /tmp/vendor.log 2>&1 \
    || { echo "vendored wheels failed:"; tail -5 /tmp/vendor.log; }
fi
