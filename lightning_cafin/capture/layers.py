"""Which modules AdaFisher preconditions, and with which rule (``rules/`` says how).

Two built-in rule sets, chosen with ``layers=`` on the optimizer:

* ``"paper"``: exactly the authors' four types, matched by exact class: ``nn.Linear``,
  ``nn.Conv2d``, ``nn.BatchNorm2d`` (affine) and ``nn.LayerNorm`` (affine, one normalised dim);
* ``"all"`` (default): every built-in type below, plus the types users registered with
  :func:`register_layer`:

  - ``nn.Linear`` and its subclasses; ``transformers``' ``Conv1D`` (weight ``in x out``);
  - ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` (transposed convolutions: F = 1);
  - ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``, ``nn.GroupNorm`` (affine);
  - ``nn.LayerNorm`` over any normalised shape; its subclasses whose ``forward`` is
    LayerNorm's own, or that are known channels-first ``LayerNorm2d`` classes
    (:data:`CHANNELS_FIRST_NORMS`) or carry ``data_format == "channels_first"``;
  - ``nn.RMSNorm`` and the RMSNorm classes of model libraries listed in
    :data:`RMS_NORMS` (by qualified class name: their ``forward`` is
    ``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim, or over dim 1 for the
    channels-first ones).

A module type is never guessed from its shape or attributes alone: a ``LayerNorm``
subclass with its own ``forward`` that is not in the lists gets F = 1 (register it to
precondition it), because its layout cannot be told from the module.

Norm modules that apply dropout and an activation after normalising (timm's norm-act
classes, :data:`NORM_ACTS`: ``norm -> self.drop -> self.act`` in one ``forward``) get their
norm's rule with the norm's own statistics: the input is the module's input, and the
output gradient is the gradient with respect to the norm's affine output, read from the
input of ``self.drop`` (:func:`gradient_tap`), not the activation's output gradient the
module's own output would give.  Other norm subclasses with an ``act`` or ``drop`` module
that is not ``nn.Identity`` get F = 1: where their affine output is cannot be told.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from .rules import ChannelNormRule, ConvRule, FeatureNormRule, KernelPlan, LayerRule, LinearRule, ParamSlot
from .rules.base import channel_sums, stat_dtype, sum_of_squares  # noqa: F401  (re-exported)

LAYER_SETS = ("all", "paper")

LINEAR = LinearRule()
LINEAR_TRANSPOSED = LinearRule(transposed=True)
CONV = {1: ConvRule(1), 2: ConvRule(2), 3: ConvRule(3)}
BATCHNORM = ChannelNormRule("batchnorm")
GROUPNORM = ChannelNormRule("groupnorm")
LAYERNORM = FeatureNormRule("layernorm")
LAYERNORM_CHANNELS_FIRST = FeatureNormRule("layernorm", channels_first=True)
RMSNORM = FeatureNormRule("rmsnorm", with_bias=False)
RMSNORM_CHANNELS_FIRST = FeatureNormRule("rmsnorm", channels_first=True, with_bias=False)

#: The authors' four types (exact classes) and their rules.
PAPER_RULES: dict[type, LayerRule] = {
    nn.Linear: LINEAR,
    nn.Conv2d: CONV[2],
    nn.BatchNorm2d: BATCHNORM,
    nn.LayerNorm: LAYERNORM,
}

#: Linear layers with a transposed (``in x out``) weight, by qualified class name.
TRANSPOSED_LINEARS = frozenset({"transformers.pytorch_utils.Conv1D"})

#: LayerNorm subclasses (by qualified class name) whose forward normalises dim 1 of ``N x C x ...``.
CHANNELS_FIRST_NORMS = frozenset({
    "torchvision.models.convnext.LayerNorm2d",
    "timm.layers.norm.LayerNorm2d",
    "timm.layers.norm.LayerNormExp2d",
})

#: LayerNorm subclasses with their own forward that still normalise the trailing dims.
CHANNELS_LAST_NORMS = frozenset({"timm.layers.norm.LayerNorm"})

#: RMSNorm classes of model libraries, by qualified class name -> channels first?
RMS_NORMS: dict[str, bool] = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": False,
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": False,
    "transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm": False,
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": False,
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": False,
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": False,
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm": False,
    "transformers.models.t5.modeling_t5.T5LayerNorm": False,
    "timm.layers.norm.RmsNorm": False,
    "timm.layers.norm.RmsNorm2d": True,
}

#: timm's norm + dropout + activation modules (exact qualified class name) -> the norm's rule.
#: Each ``forward`` is ``x = norm(x); x = self.drop(x); x = self.act(x)``: ``self.drop``'s
#: input is the norm's affine output (``gradient_tap``).
NORM_ACTS: dict[str, LayerRule] = {
    "timm.layers.norm_act.BatchNormAct2d": BATCHNORM,
    "timm.layers.norm_act.SyncBatchNormAct": BATCHNORM,
    "timm.layers.norm_act.GroupNormAct": GROUPNORM,
    "timm.layers.norm_act.GroupNorm1Act": GROUPNORM,
    "timm.layers.norm_act.LayerNormAct": LAYERNORM,
    "timm.layers.norm_act.LayerNormActFp32": LAYERNORM,
    "timm.layers.norm_act.LayerNormAct2d": LAYERNORM_CHANNELS_FIRST,
    "timm.layers.norm_act.LayerNormAct2dFp32": LAYERNORM_CHANNELS_FIRST,
    "timm.layers.norm_act.RmsNormAct": RMSNORM,
    "timm.layers.norm_act.RmsNormActFp32": RMSNORM,
    "timm.layers.norm_act.RmsNormAct2d": RMSNORM_CHANNELS_FIRST,
    "timm.layers.norm_act.RmsNormAct2dFp32": RMSNORM_CHANNELS_FIRST,
}

_USER_RULES: dict[type, LayerRule] = {}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_layer(module_type: type, rule: LayerRule) -> None:
    """Precondition every module of ``module_type`` (and its subclasses) with ``rule``.

    The rule implements :class:`LayerRule` (``lightning_cafin.capture.rules.base`` documents the
    protocol); built-in rules may be reused, e.g. ``register_layer(MyLinear, LinearRule())``.
    A registration replaces an earlier one for the same type and takes precedence over
    the built-in rules (``layers="all"`` only; ``layers="paper"`` ignores registrations).
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_layer(module_type, rule): module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(rule, LayerRule):
        raise TypeError(
            f"register_layer(module_type, rule): rule must be a lightning_cafin.capture.LayerRule instance, got "
            f"{type(rule).__name__}; subclass LayerRule (slots, input_partial, output_partial, finalize)"
        )
    _USER_RULES[module_type] = rule


def unregister_layer(module_type: type) -> None:
    """Forget a registration (tests, notebooks)."""
    _USER_RULES.pop(module_type, None)


def registered_layers() -> dict[type, LayerRule]:
    """A copy of the user registrations."""
    return dict(_USER_RULES)


def check_layers(layers: str) -> str:
    if layers not in LAYER_SETS:
        raise ValueError(f"layers must be one of {LAYER_SETS} ('all': every supported type, 'paper': the authors' "
                         f"four), got {layers!r}")
    return layers


def _own_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether ``module``'s class overrides ``base.forward``."""
    return type(module).forward is not base.forward


def fused_activation(module: nn.Module) -> bool:
    """Whether a norm module applies an activation or dropout after normalising (timm's
    ``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct``): its output gradient is not the
    norm's, so the norm rules would be wrong for it."""
    return any(isinstance(getattr(module, attr, None), nn.Module) and not isinstance(getattr(module, attr), nn.Identity)
               for attr in ("act", "drop"))


def gradient_tap(module: nn.Module) -> Optional[nn.Module]:
    """The submodule whose *input* is ``module``'s affine output, where the module's own
    output is not (a :data:`NORM_ACTS` module applying dropout or an activation); ``None``
    where the module's output gradient is its statistic's."""
    if qualified_name(type(module)) not in NORM_ACTS or not fused_activation(module):
        return None
    drop = getattr(module, "drop", None)
    return drop if isinstance(drop, nn.Module) else None


def _builtin_rule(module: nn.Module) -> Optional[LayerRule]:
    name = qualified_name(type(module))
    if name in NORM_ACTS:
        # the norm's statistics, the output gradient read where the norm's output is
        return NORM_ACTS[name] if not fused_activation(module) or gradient_tap(module) is not None else None
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
    if isinstance(module, norm_types) and fused_activation(module):
        return None  # normalisation + activation in one module, affine output unknown: F = 1
    names = {qualified_name(c) for c in type(module).__mro__}
    if names & TRANSPOSED_LINEARS:
        return LINEAR_TRANSPOSED
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return CONV[len(module.kernel_size)]
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return BATCHNORM
    if isinstance(module, nn.GroupNorm):
        return GROUPNORM
    if name in RMS_NORMS:
        return RMSNORM_CHANNELS_FIRST if RMS_NORMS[name] else RMSNORM
    if isinstance(module, nn.LayerNorm):
        if name in CHANNELS_FIRST_NORMS or getattr(module, "data_format", None) == "channels_first":
            return LAYERNORM_CHANNELS_FIRST
        if name in CHANNELS_LAST_NORMS or not _own_forward(module, nn.LayerNorm):
            return LAYERNORM
        return None  # its own forward, layout unknown: register it
    if isinstance(module, nn.RMSNorm) and not _own_forward(module, nn.RMSNorm):
        return RMSNORM
    return None


def _paper_rule(module: nn.Module) -> Optional[LayerRule]:
    rule = PAPER_RULES.get(type(module))
    if rule is None:
        return None
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        return None
    return rule


def rule_for(module: nn.Module, layers: str = "all") -> Optional[LayerRule]:
    """The rule for a supported module, or ``None`` (its parameters then use F = 1)."""
    if layers == "paper":
        rule = _paper_rule(module)
    else:
        check_layers(layers)
        rule = None
        for cls in type(module).__mro__:  # the most specific registration wins
            if cls in _USER_RULES:
                rule = _USER_RULES[cls]
                break
        if rule is None:
            rule = _builtin_rule(module)
    if rule is None or not rule.supports(module):
        return None
    return rule


def unseen_parameters(model: nn.Module) -> dict[str, str]:
    """Modules whose parameters their owner uses functionally, so hooks cannot see them:
    ``{module name: reason}``.  They get F = 1 and are reported once in ``summary()``."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            out[f"{name}.out_proj" if name else "out_proj"] = (
                "nn.MultiheadAttention calls out_proj functionally (F.multi_head_attention_forward)")
    return out


#: The built-in rules, for introspection.
RULES: tuple[LayerRule, ...] = (LINEAR, LINEAR_TRANSPOSED, *CONV.values(), BATCHNORM, GROUPNORM, LAYERNORM,
                                LAYERNORM_CHANNELS_FIRST, RMSNORM, RMSNORM_CHANNELS_FIRST)

__all__ = ["KernelPlan", "LAYER_SETS", "LayerRule", "ParamSlot", "RULES", "register_layer", "rule_for",
           "unregister_layer", "unseen_parameters"]


def Conv2dRule() -> ConvRule:  # noqa: N802 (the former class name)
    """The built-in Conv2d rule (the name of its class before the N-d rules; kept for scripts)."""
    return CONV[2]
