"""Quick check of the capture kernels against the torch rules on a few shapes, with timings.

    python scripts/capture_kernels_smoke.py
"""

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cafin._conv import conv_output_hw, conv_padding  # noqa: E402
from lightning_cafin.capture.layers import Conv2dRule  # noqa: E402
from lightning_cafin.kernels import load_extension  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def ms(fn, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ext = load_extension()
    dev = "cuda"
    rule = Conv2dRule()
    worst = 0.0
    for (B, C, H, W, O, k, s, p, d, g, dt, cl) in [
        (256, 64, 32, 32, 64, 3, 1, 1, 1, 1, torch.float32, False),
        (256, 64, 32, 32, 64, 3, 1, 1, 1, 1, torch.float32, True),
        (256, 128, 16, 16, 256, 3, 2, 1, 1, 1, torch.bfloat16, False),
        (256, 512, 4, 4, 512, 3, 1, 1, 1, 1, torch.float32, False),
        (3, 12, 9, 7, 12, 3, 2, 2, 2, 12, torch.float16, True),
        (1, 6, 5, 5, 4, 1, 1, 0, 1, 2, torch.float32, False),
    ]:
        m = nn.Conv2d(C, O, k, stride=s, padding=p, dilation=d, groups=g).to(dev)
        x = torch.randn(B, C, H, W, device=dev, dtype=dt)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        Ho, Wo = conv_output_hw(m, (H, W))
        left, _, top, _ = conv_padding(m)
        kern = lambda: ext.conv_input_stats(x, list(m.kernel_size), list(m.stride), [top, left], list(m.dilation), g, [Ho, Wo])
        ref = rule.input_partial(m, x)[0]
        got = kern()
        r = rel(got, ref)
        worst = max(worst, r)
        t_k, t_t = ms(kern), ms(lambda: rule.input_partial(m, x))
        print(f"conv in  {(B, C, H, W)} k{k} s{s} p{p} d{d} g{g} {dt} cl={cl}: rel {r:.2e}  kernel {t_k*1e3:7.1f} us  torch {t_t*1e3:7.1f} us")
        gr = torch.randn(B, O, Ho, Wo, device=dev, dtype=dt)
        if cl:
            gr = gr.contiguous(memory_format=torch.channels_last)
        kern = lambda: ext.channel_stats(gr, 1, True, 0.0)
        ref = rule.output_partial(m, gr)[0]
        r = rel(kern(), ref)
        worst = max(worst, r)
        print(f"conv out {tuple(gr.shape)} {dt} cl={cl}: rel {r:.2e}  kernel {ms(kern)*1e3:7.1f} us  torch {ms(lambda: rule.output_partial(m, gr))*1e3:7.1f} us")
        bn = lambda: ext.channel_stats(gr, 1, False, float((Ho * Wo) ** 2))
        ref = gr.sum((0, 2, 3), dtype=torch.float32) / (Ho * Wo) ** 2
        r = rel(bn(), ref)
        worst = max(worst, r)
        print(f"bn sum   {tuple(gr.shape)}: rel {r:.2e}  kernel {ms(bn)*1e3:7.1f} us")
    for (N, D, dt) in [(256, 512, torch.float32), (8192, 256, torch.bfloat16), (7, 13, torch.float16)]:
        x = torch.randn(N, D, device=dev, dtype=dt)
        kern = lambda: ext.channel_stats(x, 1, True, 0.0)
        ref = torch.linalg.vector_norm(x, 2, dim=0, dtype=torch.float32).square()
        r = rel(kern(), ref)
        worst = max(worst, r)
        print(f"linear   {(N, D)} {dt}: rel {r:.2e}  kernel {ms(kern)*1e3:7.1f} us")
    print(f"worst relative difference: {worst:.2e}", "OK" if worst < 1e-4 else "FAIL")


if __name__ == "__main__":
    main()
