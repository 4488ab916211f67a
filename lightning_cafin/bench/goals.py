"""A benchmark figure beside its goal: whether it is met, by its value and by its interval,
and the short table the bench prints last.  The matrix (``matrix.goals``), the compiled
step and the callback's cost each state their figures as ``goal_rows``.

A verdict by the interval says "undecided" where the figure's 90% interval spans the
goal: the host's step times spread by 10% and more between rounds, so a median a few
percent over a goal can be noise, and the verdict says which misses the measurement
can tell apart from it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence


@dataclass
class Goal:
    """One figure of a benchmark beside its goal, as the bench's JSON stores it (``asdict``)."""

    figure: str
    value: float
    unit: str  # "x" (a ratio), "ms" or "count"
    limit: Optional[float]  # None: reported, no goal
    met: Optional[bool]  # the value (a median, a ratio of sums) against the limit
    #: the value's 90% interval ``[low, high]`` (``timing.median_interval`` or a bootstrap), None where not measured
    interval: Optional[list[float]] = None
    #: "met" (the interval lies at or under the limit), "not met" (wholly above it), "undecided" (it spans the
    #: limit: the host's spread hides the answer), None without a limit; without an interval, the value's verdict
    verdict: Optional[str] = None

    @property
    def text(self) -> str:
        return format_value(self.value, self.unit)

    @property
    def goal_text(self) -> str:
        if self.limit is None:
            return "-"
        return f"<= {self.limit:g}" + {"x": "x", "count": ""}.get(self.unit, " ms")


def format_value(value: float, unit: str) -> str:
    """A goal's value as the tables print it: ``1.031x``, ``+0.42 ms`` or a count."""
    return {"x": f"{value:.3f}x", "count": f"{value:g}"}.get(unit, f"{value:+.2f} ms")


def verdict(value: float, limit: Optional[float], interval: Optional[Sequence[float]] = None) -> Optional[str]:
    """A goal's verdict (see ``Goal.verdict``): from the interval where there is one, else from the value."""
    if limit is None or not math.isfinite(value):
        return None
    if interval is None:
        return "met" if value <= limit else "not met"
    low, high = interval
    if high <= limit:
        return "met"
    return "not met" if low > limit else "undecided"


GoalRow = tuple  # (figure, value, unit, limit) or (figure, value, unit, limit, interval)


def goal_rows(rows: Sequence[GoalRow]) -> list[dict[str, Any]]:
    """``(figure, value, unit, limit[, interval])`` rows as :class:`Goal` dicts: ``met`` decides
    the value against the limit (``None`` without a limit or for a value that is not finite:
    no verdict), ``verdict`` the interval where there is one (:func:`verdict`)."""
    out = []
    for figure, value, unit, limit, *rest in rows:
        interval = list(rest[0]) if rest and rest[0] is not None else None
        met = None if limit is None or not math.isfinite(value) else value <= limit
        out.append(asdict(Goal(figure, value, unit, limit, met, interval, verdict(value, limit, interval))))
    return out


def goals_table(matrix: dict[str, dict[str, Any]]) -> str:
    """The short table printed last: every workload's figures beside their goals."""
    lines = [["workload", "figure", "value", "goal", ""]]
    for name, r in matrix.items():
        for g in r["goals"]:
            goal = Goal(**g)
            value = goal.text
            if goal.interval is not None:
                value += f" [{format_value(goal.interval[0], goal.unit)}, {format_value(goal.interval[1], goal.unit)}]"
            lines.append([name, goal.figure, value, goal.goal_text, (goal.verdict or "").upper()])
    widths = [max(len(row[i]) for row in lines) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in lines)
