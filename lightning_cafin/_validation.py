"""Argument checks with errors that name the argument, the value and the fix."""

from __future__ import annotations

import difflib
import math
import numbers

import torch

#: Names users bring from other versions of the authors' code, with what to use instead.
LEGACY_ARGUMENTS = {
    "gammas": "AdaFisher takes one `gamma` (default 0.8); the factors are averaged as "
    "0.1*gamma*old + 0.01*gamma*new. Replace gammas=[...] by gamma=<float>.",
    "betas": "AdaFisher keeps one momentum buffer: pass beta=<float> (default 0.9), not betas=(b1, b2).",
    "eps": "AdaFisher has no epsilon: the damping `Lambda` (default 1e-3) keeps F positive.",
    "damping": "the damping is called `Lambda` (default 1e-3).",
    "lambda_": "the damping is called `Lambda` (default 1e-3).",
    "tcov": "the factor-update interval is spelled `TCov` (default 100).",
    "T_cov": "the factor-update interval is spelled `TCov` (default 100).",
    "Tcov": "the factor-update interval is spelled `TCov` (default 100).",
    "beta3": "there is no beta3: `gamma` (default 0.8) controls the factor averaging.",
    "kappa": "there is no kappa in this version of AdaFisher.",
    "fused": "choose the implementation with backend='fused' (or 'auto', 'foreach', 'reference').",
    "foreach": "choose the implementation with backend='foreach' (or 'auto', 'fused', 'reference').",
}


def reject_unknown_kwargs(cls_name: str, kwargs: dict, known: list[str]) -> None:
    """Raise ``TypeError`` for unexpected keyword arguments, with a hint for each."""
    if not kwargs:
        return
    lines = []
    for name in kwargs:
        hint = LEGACY_ARGUMENTS.get(name)
        if hint is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"accepted arguments: {', '.join(known)}."
        lines.append(f"  {name}: {hint}")
    raise TypeError(f"{cls_name} got unexpected keyword argument(s):\n" + "\n".join(lines))


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _lr(lr) -> float:
    """A number, or a one-element floating tensor (read once here, then on the device)."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point() or lr.requires_grad:
            raise TypeError(
                f"lr given as a tensor must be a one-element floating tensor without grad, got shape "
                f"{tuple(lr.shape)} dtype {lr.dtype}; for a CUDA graph use torch.tensor(lr, device='cuda')"
            )
        return _number("lr", float(lr))
    return _number("lr", lr)


def check_hyperparameters(lr, beta, gamma, Lambda, TCov, weight_decay) -> None:
    """Validate one set of hyper-parameters (defaults or one param group)."""
    if _lr(lr) < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= _number("beta", beta) < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta} (it is the momentum coefficient; the default is 0.9)")
    if not 0.0 < _number("gamma", gamma) <= 10.0:
        raise ValueError(
            f"gamma must be in (0, 10], got {gamma}: factors are averaged as 0.1*gamma*old + 0.01*gamma*new "
            "(the default, 0.8, is the paper's)"
        )
    if _number("Lambda", Lambda) <= 0:
        raise ValueError(f"Lambda must be > 0, got {Lambda}: it is the damping that keeps F = S*H + Lambda positive")
    if isinstance(TCov, bool) or not isinstance(TCov, numbers.Integral) or TCov < 1:
        raise ValueError(f"TCov must be an integer >= 1 (factors are re-estimated every TCov steps), got {TCov!r}")
    if _number("weight_decay", weight_decay) < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def checked_param_group(owner: str, param_group: dict, defaults: dict) -> dict:
    """A copy of ``param_group`` with its ``params`` as a list, validated against ``defaults``.

    Rejects complex parameters and a per-group ``gamma`` / ``TCov`` (the factor schedule
    is shared by all groups); a tensor ``lr`` inherited from the defaults is cloned, so
    that each group owns the tensor a scheduler fills in place.
    """
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)  # may be a generator
    param_group = {**param_group, "params": params}
    for p in params:
        if isinstance(p, torch.Tensor) and torch.is_complex(p):
            raise TypeError(
                f"{owner} does not support complex parameters (got one of dtype {p.dtype}); "
                "optimise torch.view_as_real(param) instead"
            )
    for key in ("gamma", "TCov"):
        if key in param_group and param_group[key] != defaults[key]:
            raise ValueError(
                f"{key}={param_group[key]!r} in a param group differs from the optimizer's {key}="
                f"{defaults[key]!r}: the factor schedule is shared by all groups; set {key} on the optimizer"
            )
    merged = {**defaults, **param_group}
    check_hyperparameters(*(merged[k] for k in ("lr", "beta", "gamma", "Lambda", "TCov", "weight_decay")))
    if isinstance(merged["lr"], torch.Tensor) and "lr" not in param_group:
        param_group["lr"] = merged["lr"].clone()
    return param_group
