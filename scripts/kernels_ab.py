"""Two runs of ``scripts/step_kernels.py`` side by side: per workload, the package's kernels
per capture step in each, the change in total and per kernel, and the launches that moved
most.

    python scripts/kernels_ab.py bench-B.log bench-A.log            # change = second - first
    python scripts/kernels_ab.py before.log after.log --top 20

Why: an A/B of a capture kernel (``scripts/gpu_ab.sh`` with ``AB_CMD`` running
``step_kernels.py``) leaves two logs of launches in launch order, a hundred or so a
workload.  Their totals say whether a change paid; which launches moved says where it acts
(on ResNet-50 the streaming loads of ce4cff8 took up to 5 us off a 1 x 1 layer's launch and
nothing off the stem's), and that was read off the logs by hand.

The totals here are sums of the logged per-launch times (0.1 us each), so they can differ
from the report's own total line in the last digit.  A log may hold several rounds of a
workload (``gpu_ab.sh``'s ``AB_ROUNDS``, its "== round" lines): each launch's time is then
the median over the rounds that launched the same kernels.  Per-launch changes are shown
only where both runs launched the same kernels in the same order; else the per-kernel
totals alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

_WORKLOAD = re.compile(r"^workload (\S+): ")
_LAUNCH = re.compile(r"^\s+(\d+)\s+(-?[\d.]+)\s+(\S.*?)\s*$")

#: one report's launches: (kernel name, device us) in launch order
Launches = list[tuple[str, float]]


def parse_log(text: str) -> dict[str, list[Launches]]:
    """Every ``step_kernels.py`` report in ``text``: per workload, one list of launches per
    report (a round), in the order they appear."""
    reports: dict[str, list[Launches]] = defaultdict(list)
    current: Optional[Launches] = None
    for line in text.splitlines():
        if (m := _WORKLOAD.match(line)) is not None:
            current = []
            reports[m.group(1)].append(current)
        elif line.startswith(("  total ", "== ")):
            current = None  # (a report ends at its total; gpu_ab.sh's round markers end one too)
        elif current is not None and (m := _LAUNCH.match(line)) is not None and int(m.group(1)) == len(current):
            current.append((m.group(3), float(m.group(2))))
        # (anything else, a warning the run printed among the rows, is passed over)
    return {name: [r for r in runs if r] for name, runs in reports.items() if any(runs)}


def combine(runs: list[Launches]) -> tuple[Launches, int]:
    """One list of launches from a workload's rounds: each launch's median over the rounds that
    launched the same kernels as the first, and how many rounds that was."""
    names = [name for name, _ in runs[0]]
    same = [run for run in runs if [name for name, _ in run] == names]
    return [(name, statistics.median(run[i][1] for run in same)) for i, name in enumerate(names)], len(same)


def per_kernel(launches: Launches) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for name, us in launches:
        totals[name] += us
    return totals


def _change(first: float, second: float) -> str:
    pct = f", {100.0 * (second - first) / first:+.1f}%" if first > 0 else ""
    return f"{first:.1f} -> {second:.1f} us ({second - first:+.1f}{pct})"


def compare(first: dict[str, list[Launches]], second: dict[str, list[Launches]], top: int) -> str:
    """The side-by-side report: per workload both logs hold, the totals, the totals per kernel
    (the largest first) and the ``top`` launches whose time changed most; then the workloads
    only one log holds."""
    lines = []
    for workload in [w for w in first if w in second]:
        (a, na), (b, nb) = combine(first[workload]), combine(second[workload])
        rounds = f" (rounds: {na} and {nb})" if max(na, nb) > 1 else ""
        lines.append(f"workload {workload}: the package's kernels per capture step "
                     f"{_change(sum(us for _, us in a), sum(us for _, us in b))}{rounds}")
        ka, kb = per_kernel(a), per_kernel(b)
        kernels = sorted(set(ka) | set(kb), key=lambda k: -max(ka.get(k, 0.0), kb.get(k, 0.0)))
        lines.append("  per kernel:")
        lines += [f"    {k}: {_change(ka.get(k, 0.0), kb.get(k, 0.0))}" for k in kernels]
        if [n for n, _ in a] != [n for n, _ in b]:
            lines.append(f"  the runs launched different kernels ({len(a)} and {len(b)} launches): "
                         "no per-launch changes")
            continue
        moved = sorted(range(len(a)), key=lambda i: -abs(b[i][1] - a[i][1]))[:top]
        lines.append(f"  the {len(moved)} launches that moved most (launch, kernel, first -> second):")
        lines += [f"    {i:4d}  {a[i][0]}: {a[i][1]:.1f} -> {b[i][1]:.1f} us ({b[i][1] - a[i][1]:+.1f})"
                  for i in sorted(moved)]
    for name, log, other in ((first, "first", second), (second, "second", first)):
        only = [w for w in name if w not in other]
        if only:
            lines.append(f"only in the {log} log: {', '.join(only)}")
    return "\n".join(lines)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", type=Path, help="a log of step_kernels.py reports (the change is second - first)")
    ap.add_argument("second", type=Path, help="another, of the same workloads")
    ap.add_argument("--top", type=int, default=10, help="launches listed per workload (default 10)")
    args = ap.parse_args(argv)
    if args.top < 0:
        ap.error(f"--top must be 0 or more, got {args.top}")
    for flag in ("first", "second"):
        path = getattr(args, flag)
        if not path.is_file():
            ap.error(f"{flag}: no such file: {path}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    logs = []
    for path in (args.first, args.second):
        reports = parse_log(path.read_text())
        if not reports:
            print(f"kernels_ab.py: {path} holds no step_kernels.py report (no 'workload NAME: ...' line "
                  "followed by numbered launches)", file=sys.stderr)
            return 2
        logs.append(reports)
    print(f"first: {args.first}\nsecond: {args.second}")
    print(compare(logs[0], logs[1], args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
