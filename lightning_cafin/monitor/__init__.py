"""Measuring the optimizer while it trains: latency, a shadow baseline step, memory, tags."""

from .memory import TemporaryMemory
from .shadow import Divergence, Snapshot, take_snapshot
from .tags import TAGS, custom_scalars_layout
from .timing import StepTimer

__all__ = ["Divergence", "Snapshot", "StepTimer", "TAGS", "TemporaryMemory", "custom_scalars_layout", "take_snapshot"]
