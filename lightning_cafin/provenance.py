"""Where a measured file came from: the command, the commit, the machine, the versions, the date.

Every results file the project commits carries this block; the README's results section
refuses files without it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time

import torch

from . import __version__

#: The fields every committed results file must carry.
REQUIRED_FIELDS = ("command", "commit", "machine", "torch", "date")


def current_commit() -> str:
    """The checked-out commit: ``$CAFIN_COMMIT`` (a copied tree without git history), else ``git``; or 'unknown'."""
    commit = os.environ.get("CAFIN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
        except Exception:
            commit = ""
    return commit if re.fullmatch(r"[0-9a-f]{7,40}", commit) else "unknown"


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def provenance(device: torch.device, command: str) -> dict:
    return {
        "command": command,
        "commit": current_commit(),
        "machine": machine_name(device),
        "torch": torch.__version__,
        "lightning_cafin": __version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
