"""Factor capture: supported layers and their rules, hooks, and the capture-step factor update."""

from .factors import update_factors
from .hooks import hook_count
from .layer_capture import LayerCapture
from .layers import RULES, register_layer, registered_layers, rule_for, unregister_layer
from .rules import ChannelNormRule, ConvRule, FeatureNormRule, KernelPlan, LayerRule, LinearRule, ParamSlot

__all__ = [
    "ChannelNormRule", "ConvRule", "FeatureNormRule", "KernelPlan", "LayerCapture", "LayerRule", "LinearRule",
    "ParamSlot", "RULES", "hook_count", "register_layer", "registered_layers", "rule_for", "unregister_layer",
    "update_factors",
]
