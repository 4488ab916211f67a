"""The Preconditioner statistics computed the slow, obvious way: the full F matrix in float64."""

from __future__ import annotations

import torch

from lightning_cafin.monitor.tags import ALL_LAYERS


def offline_stats(factors: dict, Lambda: float, previous: dict | None = None) -> dict[str, dict[str, float]]:
    """``factors``: ``{name: (layer_type, S, H)}``; returns ``{series: {key: value}}``."""
    per_layer = {}
    for name, (layer_type, S, H) in factors.items():
        SH = torch.outer(S.double().cpu(), H.double().cpu())
        F = SH + Lambda
        row = {"F_min": float(F.min()), "F_max": float(F.max()), "count": int((SH < Lambda).sum()),
               "n": SH.numel(), "type": layer_type}
        if previous is not None and name in previous:
            _, S0, H0 = previous[name]
            old = torch.outer(S0.double().cpu(), H0.double().cpu())
            row["change"] = float(torch.linalg.norm(SH - old) / torch.linalg.norm(old))
        per_layer[name] = row
    groups = {ALL_LAYERS: list(per_layer.values())}
    for row in per_layer.values():
        groups.setdefault(row["type"], []).append(row)
    out = {}
    for series, rows in groups.items():
        stats = {
            "F_min_per_Lambda": min(r["F_min"] for r in rows) / Lambda,
            "F_max_per_Lambda": max(r["F_max"] for r in rows) / Lambda,
            "lambda_dominated": sum(r["count"] for r in rows) / sum(r["n"] for r in rows),
        }
        if all("change" in r for r in rows):
            stats["factor_change"] = max(r["change"] for r in rows)
        out[series] = stats
    return out
