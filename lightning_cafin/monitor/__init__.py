"""Passive monitoring of the optimizer: latency, capture cost, a shadow baseline step,
memory, the preconditioner's health, and the tags and layout of the dashboard."""

from .capture_cost import CaptureCost
from .memory import AllocatedMemory
from .observer import OptimizerMonitor
from .preconditioner import PreconditionerHealth
from .shadow import Divergence, Snapshot, take_snapshot
from .tags import CHARTS, custom_scalars_layout
from .timing import StepTimer

__all__ = [
    "AllocatedMemory", "CHARTS", "CaptureCost", "Divergence", "OptimizerMonitor", "PreconditionerHealth", "Snapshot",
    "StepTimer", "custom_scalars_layout", "take_snapshot",
]
