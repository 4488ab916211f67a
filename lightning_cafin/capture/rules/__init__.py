"""The built-in layer rules, one module per family (see ``base.py`` for the protocol)."""

from .base import FusedStats, KernelPlan, LayerRule, ParamSlot, channel_sums, stat_dtype, sum_of_squares
from .conv import ConvRule
from .linear import LinearRule
from .norms import ChannelNormRule, FeatureNormRule

__all__ = [
    "ChannelNormRule",
    "ConvRule",
    "FeatureNormRule",
    "FusedStats",
    "KernelPlan",
    "LayerRule",
    "LinearRule",
    "ParamSlot",
    "channel_sums",
    "stat_dtype",
    "sum_of_squares",
]
