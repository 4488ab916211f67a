"""Where a capture step's extra forward+backward time goes (CIFAR ResNet-18, batch 256).

Measures, with CUDA events (median of --reps):
  plain      forward+backward, no capture
  capture    forward+backward with the capture hooks and rules (what the bench's capture_ms is)
  hooks-only the hooks firing but the rules replaced by returning cached tensors
             (host-side hook overhead, no statistics work)
  factors    update_factors on the pending statistics of one capture
then the statistics rules alone per layer kind (their GPU time on recorded shapes),
the host time to enqueue each variant (no sync), and a torch.profiler table of one
capture forward+backward.  Everything is printed and written under --out.

    python scripts/profile_capture.py --out $OUT [--impl torch|kernels|auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cafin import AdaFisher  # noqa: E402
from lightning_cafin.bench import extra_ms, median_ms as bench_median_ms  # noqa: E402
from lightning_cafin.capture import factors as factors_mod  # noqa: E402
from lightning_cafin.capture import streams as capture_streams  # noqa: E402
from lightning_cafin.models import ResNet18  # noqa: E402


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run of this script


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps, warmup=3):
    return bench_median_ms(fn, DEV, reps, warmup)


def host_ms(fn, reps):
    """Host time to enqueue fn (sync before, not after): > GPU time means host-bound."""
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile_out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--dtype", default="float32", help="autocast dtype for the forward (float32: none)")
    ap.add_argument("--impl", default=None, choices=["auto", "kernels", "torch"],
                    help="the optimizer's capture= option (default: the process default)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    if args.impl is not None:
        say(f"capture impl: {args.impl}")
    dev = DEV
    torch.manual_seed(0)
    model = ResNet18(10, 3, 64).to(dev)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 32, 32, device=dev)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    opt = AdaFisher(model, lr=1e-3, weight_decay=5e-4, TCov=10**9, backend="foreach", capture=args.impl)
    amp = None if args.dtype == "float32" else getattr(torch, args.dtype)

    def fwd_bwd():
        opt.zero_grad(set_to_none=False)
        with torch.autocast(DEV.type, dtype=amp, enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    def capturing():
        opt.capture_next_step()
        fwd_bwd()
        opt.capture_next_step(False)
        capture_streams.join()  # as the step does: wait for the side-stream statistics
        opt.binding.discard_pending()
        capture_streams.release()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            fwd_bwd()
            opt.step()
    caps = list(opt.binding.captures.values())

    # record the shapes each rule sees
    seen = {}
    rules = {}
    for cap in caps:
        rule = cap.rule
        if id(rule) in rules:
            continue
        rules[id(rule)] = rule
    originals = {rid: (r.input_partial, r.output_partial) for rid, r in rules.items()}

    def recording(rule, which, fn):
        def wrapped(module, t):
            res = fn(module, t)
            seen.setdefault((id(module), which), (rule, module, t.detach().clone()))
            return res
        return wrapped

    for rid, r in rules.items():
        ip, op = originals[rid]
        r.input_partial = recording(r, "in", ip)
        r.output_partial = recording(r, "out", op)
    capturing()
    for rid, r in rules.items():
        del r.input_partial, r.output_partial  # back to the class methods

    plain = median_ms(fwd_bwd, args.reps)
    capt = median_ms(capturing, args.reps)
    # hooks only: rules return cached results
    cache = {}
    for (mid, which), (rule, module, t) in seen.items():
        cache[(mid, which)] = (rule.input_partial if which == "in" else rule.output_partial)(module, t)
    for rid, r in rules.items():
        r.input_partial = lambda module, t, _w="in": cache[(id(module), _w)]
        r.output_partial = lambda module, t, _w="out": cache[(id(module), _w)]
    hooks_only = median_ms(capturing, args.reps)
    host_hooks = host_ms(capturing, args.reps)
    for rid, r in rules.items():
        del r.input_partial, r.output_partial
    host_plain = host_ms(fwd_bwd, args.reps)
    host_capt = host_ms(capturing, args.reps)
    was = capture_streams.set_enabled(False)
    capt_cur = median_ms(capturing, args.reps)
    host_capt_cur = host_ms(capturing, args.reps)
    capture_streams.set_enabled(was)

    def one_capture_update():
        opt.capture_next_step()
        fwd_bwd()
        opt.capture_next_step(False)
        factors_mod.update_factors(caps, 0.8, None)

    with_factors = median_ms(one_capture_update, args.reps)
    host_factors = host_ms(lambda: factors_mod.update_factors(caps, 0.8, None), 5)

    say(f"batch {args.batch}, channels_last {args.channels_last}, autocast {args.dtype}, {len(caps)} captured layers")
    say(f"plain fwd+bwd            {plain:8.3f} ms  (host enqueue {host_plain:.3f} ms)")
    say(f"capture fwd+bwd          {capt:8.3f} ms  (+{capt - plain:.3f})  host enqueue {host_capt:.3f} ms")
    say(f"capture, no side stream  {capt_cur:8.3f} ms  (+{capt_cur - plain:.3f})  host enqueue {host_capt_cur:.3f} ms")
    say(f"hooks only (no rules)    {hooks_only:8.3f} ms  (+{hooks_only - plain:.3f})  host enqueue {host_hooks:.3f} ms")
    say(f"capture + update_factors {with_factors:8.3f} ms  (+{with_factors - capt:.3f} over capture)")

    # the medians above are taken one after another and drift; these are interleaved pairs
    def with_side(on):
        def run():
            was = capture_streams.set_enabled(on)
            try:
                capturing()
            finally:
                capture_streams.set_enabled(was)
        return run

    reps2 = 2 * args.reps
    say("paired (median of interleaved pairs, the bench's capture_ms method):")
    say(f"  capture - plain, side stream      {extra_ms(fwd_bwd, with_side(True), DEV, reps2):+8.3f} ms")
    say(f"  capture - plain, current stream   {extra_ms(fwd_bwd, with_side(False), DEV, reps2):+8.3f} ms")
    say(f"  side stream - current stream      {extra_ms(with_side(False), with_side(True), DEV, reps2):+8.3f} ms")
    say()

    # rules alone, per kind, GPU time
    per_kind = defaultdict(float)
    per_layer = []
    for (mid, which), (rule, module, t) in seen.items():
        fn = rule.input_partial if which == "in" else rule.output_partial
        ms = median_ms(lambda: fn(module, t), 20)
        hms = host_ms(lambda: fn(module, t), 20)
        per_kind[(rule.kind, which)] += ms
        per_layer.append((ms, hms, rule.kind, which, tuple(t.shape), t.dtype, t.is_contiguous()))
    say("rule GPU time summed per kind (each call alone, synced):")
    for (kind, which), ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        say(f"  {kind:12s} {which:4s} {ms:8.3f} ms")
    say(f"  total        {sum(per_kind.values()):8.3f} ms")
    say("slowest single calls (gpu ms, host ms, kind, side, shape, dtype, contiguous):")
    for row in sorted(per_layer, reverse=True)[:12]:
        say(f"  {row[0]:7.3f} {row[1]:7.3f}  {row[2]:12s} {row[3]:4s} {row[4]} {row[5]} {row[6]}")
    say()

    from torch.profiler import ProfilerActivity, profile

    ACTS = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    sort = "cuda_time_total" if DEV.type == "cuda" else "cpu_time_total"

    with profile(activities=ACTS) as prof:
        for _ in range(3):
            capturing()
        _sync()
    table = prof.key_averages().table(sort_by=sort, row_limit=35)
    say("torch.profiler, 3 capture fwd+bwd, by CUDA time:")
    say(table)
    with profile(activities=ACTS) as prof2:
        for _ in range(3):
            fwd_bwd()
        _sync()
    say("torch.profiler, 3 plain fwd+bwd, by CUDA time:")
    say(prof2.key_averages().table(sort_by=sort, row_limit=20))
    (out / "profile_capture.txt").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
