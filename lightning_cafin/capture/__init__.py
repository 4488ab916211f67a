"""Factor capture: supported layers, hooks, and the capture-step factor update."""

from .factors import update_factors
from .hooks import LayerCapture, hook_count
from .layers import RULES, LayerRule, ParamSlot, rule_for

__all__ = ["LayerCapture", "LayerRule", "ParamSlot", "RULES", "hook_count", "rule_for", "update_factors"]
