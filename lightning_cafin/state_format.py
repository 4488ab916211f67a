"""Where AdaFisher's own state goes in an optimizer state dict, and how it comes back.

torch's optimizer state dict holds per-parameter state and param groups; AdaFisher adds
the capture schedule and the layer factors (by module name).  They are stored in the
first param group, under ``"cafin"``, because ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (what Lightning's
``ModelParallelStrategy`` saves and loads through) keep only ``state`` and
``param_groups``.  The factors travel as one serialised blob there: a distributed
checkpoint is loaded *into* a state dict of the same structure taken from the fresh
optimizer, which has no factors yet to give the tensors their shapes; a blob loads
whole, whatever the shapes and the number of ranks (the factors are the same on every
rank).  Format 1 (a top-level ``"cafin"`` with the factors as tensors) still loads.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Optional

import torch

KEY = "cafin"
FORMAT = 2
_KNOWN_FORMATS = (1, 2)


def with_record(sd: dict[str, Any], schedule: Mapping[str, Any], factors: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``sd`` (torch's state dict, fresh from ``Optimizer.state_dict``) with AdaFisher's record added."""
    buffer = io.BytesIO()
    torch.save({name: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in f.items()}
                for name, f in factors.items()}, buffer)
    groups = [dict(g) for g in sd["param_groups"]]
    groups[0][KEY] = {"format": FORMAT, **schedule, "factors": buffer.getvalue()}
    return {**sd, "param_groups": groups}


def split_record(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """``(torch's part, AdaFisher's record or None)``; the caller's dict is left untouched."""
    torch_part = dict(state_dict)
    record = torch_part.pop(KEY, None)
    groups = []
    for group in torch_part.get("param_groups", []):
        group = dict(group)
        found = group.pop(KEY, None)
        if found is not None:
            record = found
        groups.append(group)
    if "param_groups" in torch_part:
        torch_part["param_groups"] = groups
    if record is not None and record.get("format") not in _KNOWN_FORMATS:
        raise ValueError(f"unknown AdaFisher state format {record.get('format')!r} (expected one of {_KNOWN_FORMATS})")
    return torch_part, None if record is None else dict(record)


def factors_of(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The factors of a record (module name -> ``{"S", "H", "layer_type"}``)."""
    factors = record["factors"]
    if isinstance(factors, (bytes, bytearray)):
        factors = torch.load(io.BytesIO(factors), weights_only=True)
    return dict(factors)
