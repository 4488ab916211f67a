#!/usr/bin/env bash
# Runs a command with the system CUDA toolkit really hidden: in a private mount namespace,
# every /usr/local/cuda* toolkit is covered by an empty tmpfs and every nvcc on PATH outside
# the virtual environment by /dev/null.  Proves that a build needs nothing but pip wheels.
# Needs root (or passwordless sudo) for `unshare -m`; exits 3 when that is not allowed.
#   scripts/hide_system_cuda.sh python -m lightning_cafin.kernels.loader --build
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
    if sudo -n true 2>/dev/null; then exec sudo -n -E env "PATH=$PATH" "$0" "$@"; fi
    echo "hide_system_cuda: needs root or passwordless sudo for unshare -m" >&2; exit 3
fi
if ! unshare -m true 2>/dev/null; then
    echo "hide_system_cuda: unshare -m is not allowed here (a container without CAP_SYS_ADMIN?)" >&2; exit 3
fi
toolkits=$(for d in /usr/local/cuda /usr/local/cuda-*; do [ -e "$d" ] && readlink -f "$d"; done | sort -u)
wrappers=$(type -ap nvcc 2>/dev/null | grep -v "^${VIRTUAL_ENV:-/nonexistent}/" || true)
exec unshare -m bash -c '
    set -e
    for d in $1; do [ -d "$d" ] && mount -t tmpfs -o size=1m none "$d"; done
    for w in $2; do mount --bind /dev/null "$w"; done
    if command -v nvcc >/dev/null 2>&1 && [ -x "$(command -v nvcc)" ] && [ -s "$(command -v nvcc)" ]; then
        echo "hide_system_cuda: nvcc still visible at $(command -v nvcc)" >&2; exit 4
    fi
    echo "hide_system_cuda: hidden: ${1//$'\''\n'\''/ } ${2//$'\''\n'\''/ }" >&2
    shift 2; exec "$@"' hide "$toolkits" "$wrappers" "$@"
