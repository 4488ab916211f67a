"""The capture side stream runs beside the current stream, whatever streams the process made
before it.

A CUDA stream's work goes to one of the device's few hardware queues (8 by default), given
out in turn as streams are made; a side stream that shares the current stream's queue waits
behind the backward pass as if it were on the current stream.  The extension checks the
stream it takes from torch's pool when it makes it (``csrc/side_stream_check.h``) and takes
the next one while a spin on it waits behind one on the current stream.  Each case is a
fresh process, which makes ``n`` streams first, moving the side stream along the queues."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After `n` streams from torch's pool: one capture step of a small model on the side stream
# (which makes it, in the backward pass, as in training), its check, the side stream (as
# streams.beside makes it current), and two spins (one on the current stream, then one on
# the side stream) timed on the host over one spin alone, best of five.
PROBE = """
import sys, time, torch
from torch import nn
from lightning_cafin import AdaFisher
from lightning_cafin.capture import streams
taken = [torch.cuda.Stream() for _ in range(int(sys.argv[1]))]
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10)).cuda()
opt = AdaFisher(model, TCov=1, capture_stream=True)
assert streams.side_stream_check() is None  # not made yet
model(torch.randn(8, 3, 8, 8, device="cuda")).logsumexp(1).sum().backward()
opt.step()
check = streams.side_stream_check()
streams.set_enabled(True)
with streams.beside(torch.randn(64, device="cuda")):
    side = torch.cuda.current_stream()
streams.join(); streams.release()
cur = torch.cuda.current_stream()
assert side != cur and all(side != s for s in taken)

def spins(streams):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(4_000_000)
    torch.cuda.synchronize()
    return time.perf_counter() - t

spins([cur])
alone = min(spins([cur]) for _ in range(5))
both = min(spins([cur, side]) for _ in range(5))
print(f"RESULT {check.tried} {check.ratio:.3f} {check.beside} {both / alone:.3f}")
"""


@pytest.mark.parametrize("made_before", range(9))
def test_the_side_stream_runs_beside_the_current_stream(fused_ok, made_before):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(made_before)], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tried, check_ratio, beside, spin_ratio = out.stdout.split("RESULT ")[1].split()
    assert 1 <= int(tried) <= 8 and beside == "True"
    # its own check found it beside the current stream, and so do torch's spins: about 1
    # side by side, about 2 one after the other
    assert float(check_ratio) < 1.5, out.stdout
    assert float(spin_ratio) < 1.5, out.stdout


def test_with_one_hardware_queue_the_first_stream_is_kept_with_a_warning(fused_ok):
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` (as some launchers set it) gives every stream one
    queue: no stream runs beside the current one, and the user is told what that costs."""
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, "0"], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tried, check_ratio, beside, spin_ratio = out.stdout.split("RESULT ")[1].split()
    assert int(tried) == 8 and beside == "False" and float(check_ratio) > 1.5 and float(spin_ratio) > 1.5, out.stdout
    assert "runs beside the current stream" in out.stderr and "capture_stream=False" in out.stderr
