# Sourced by scripts/quickstart.sh and .ci/run: a project virtual environment in .venv,
# created with a stock Python and installed into, so that PEP 668 systems (Debian 12,
# Ubuntu 24.04: `pip install` outside a venv is refused) work as they come.
#
#   PYTHON    the interpreter that creates .venv (default: /usr/bin/python3 where it exists,
#             the distribution's Python that a fresh machine has, else python3 on PATH)
#   VENV      where the environment lives (default: .venv in the repository)
#
# Rerunning is cheap: the install is skipped while .venv holds a stamp of the same
# pyproject.toml, setup.py and extras.

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
VENV="${VENV:-$PWD/.venv}"

_sudo() { if [ "$(id -u)" -ne 0 ]; then sudo "$@"; else "$@"; fi; }

# apt-get install, waiting for a lock another apt holds instead of failing at once.
apt_install() {
    echo "== apt-get install $*"
    _sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
    _sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@"
}

ensure_fashion_mnist() {
    if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${CAFIN_DATA_DIR:-}" ]; then
        apt_install dataset-fashion-mnist
    fi
}

# Creates (or reuses) $VENV with $PYTHON; Debian's python3 needs python3-venv for that.
ensure_venv() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sys" 2>/dev/null; then
        return
    fi
    if ! "$PYTHON" -c "import venv, ensurepip" 2>/dev/null; then
        local minor
        minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        apt_install "python${minor}-venv" || apt_install python3-venv
    fi
    echo "== creating the virtual environment $VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
}

# ensure_free_space DIR GB: stops with the figures and what to do when DIR's file system has
# less than GB gigabytes free.  Installing torch's CUDA build and its NVIDIA wheels takes about
# 7 GB in .venv plus pip's unpacking in TMPDIR; running out half-way leaves a broken .venv
# behind an "[Errno 28] No space left on device" from deep inside pip.  The needs can be
# set with CAFIN_INSTALL_NEEDS_GB (the venv's disk) and CAFIN_INSTALL_TMP_NEEDS_GB (TMPDIR).
ensure_free_space() {
    local dir="$1" need_gb="$2" free_kb
    mkdir -p "$dir"
    free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
    if [ "$free_kb" -lt $(( need_gb * 1024 * 1024 )) ]; then
        echo "error: $dir has $(( free_kb / 1024 / 1024 )) GB free; installing lightning-cafin with torch needs about ${need_gb} GB there." >&2
        echo "       Free space (old virtual environments or clones, ~/.cache/pip), or point VENV= / TMPDIR= at a larger disk." >&2
        exit 1
    fi
}

# install_project EXTRAS: pip install -e ".[EXTRAS]" into $VENV unless a stamp of the same
# pyproject.toml and setup.py says these extras (or more) are installed already.
install_project() {
    local requested="$1" key stamp have="" extras missing=0 e
    key=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
    stamp="$VENV/.lightning_cafin-installed-$key"
    [ -f "$stamp" ] && have=$(cat "$stamp")
    [ -f "$stamp" ] || missing=1
    for e in ${requested//,/ }; do
        grep -qx "$e" <<<"$have" || missing=1
    done
    if [ "$missing" -eq 0 ]; then
        echo "== lightning-cafin${have:+[$(paste -sd, <<<"$have")]} already installed in $VENV (same pyproject.toml): skipped"
        return
    fi
    extras=$(printf '%s\n' $have ${requested//,/ } | sed '/^$/d' | sort -u | paste -sd, -)
    ensure_free_space "$(dirname "$VENV")" "${CAFIN_INSTALL_NEEDS_GB:-10}"
    ensure_free_space "${TMPDIR:-/tmp}" "${CAFIN_INSTALL_TMP_NEEDS_GB:-3}"
    echo "== installing lightning-cafin${extras:+[$extras]} and its dependencies into $VENV (torch is large: minutes the first time)"
    "$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
    rm -f "$VENV"/.lightning_cafin-installed-*
    tr ',' '\n' <<<"$extras" > "$stamp"
}

# The toolkit wheels are worth installing where a GPU is (the extension is built on first
# use) but no nvcc: torch's wheels bring no compiler.
wants_cuda_build_wheels() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
        && ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ] && [ ! -x /usr/local/cuda/bin/nvcc ]
}
