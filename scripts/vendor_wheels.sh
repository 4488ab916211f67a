#!/usr/bin/env bash
# The GPU machine has torch and lightning but no registry access: download the pure-Python
# wheels the CLI needs (jsonargparse and its signature extras) into ./vendor, carry that folder,
# and install them there with:  pip install --no-index --find-links vendor "jsonargparse[signatures]"
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --only-binary=:all: --no-deps -d vendor \
    "jsonargparse>=4.39,<5" "docstring-parser>=0.15" "typeshed-client>=2.1"
ls vendor
