""":class:`ExtensionInfo`: what one attempt to load the extension came to.

Its own module because every way of getting the extension (a prebuilt copy, a build,
the loader's cache) reports in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ExtensionInfo:
    """Whether the extension is usable in this process, and if not, why."""

    loaded: bool
    reason: str
    build_dir: Optional[str] = None
    log_path: Optional[str] = None
