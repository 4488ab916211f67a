"""The kept factor update (``csrc/factor_launch.h``: the extension's ``FactorLaunch`` and
``HostFlags``) against ``factor_update_`` on the same random layers (GPU only).

A kept launch builds its layers' launch items once and takes new sums at every run; its
kernel writes the NaN flags straight into pinned host memory.  Checked: the factors equal
``factor_update_``'s bit for bit over several runs and several launches' worth of layers,
NaN layers included; each run's flags read back as its own, also with an earlier run's
flags still unread (their buffers are reused only once read); sums that do not fit, and a
stream being captured into a CUDA graph, are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from .test_capture_kernels import ext  # noqa: F401  (the fixture: the extension with the capture kernels)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the kept factor update needs a CUDA device"),
]

DEV = "cuda"


def random_layers(L: int, gen: torch.Generator) -> list[dict]:
    """L layers of both kinds and every flag, with fresh random factors and the sizes of
    their sums (nh, ns)."""
    layers = []
    for i in range(L):
        kind = 1 if i % 5 == 4 else 0
        flags = (1 if kind == 0 and i % 3 == 0 else 0) | (2 if i % 7 == 0 else 0) | (4 if i % 2 == 0 else 0)
        nh, ns = (int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(2))
        n_H = 2 if kind == 1 else nh + (flags & 1)
        layers.append({
            "nh": nh, "ns": ns, "kind": kind, "flags": flags,
            "H": torch.rand(n_H, generator=gen).add_(0.5).to(DEV), "S": torch.rand(ns, generator=gen).add_(0.5).to(DEV),
            "scalars": (float(i % 9 + 1), float(i % 4 + 2), 1024.0 if flags & 4 else 1.0, 0.5 + i % 3),
        })
    return layers


def random_sums(layers: list[dict], gen: torch.Generator, nan_at: set[int]) -> tuple[list, list]:
    hs, ss = [], []
    for i, lay in enumerate(layers):
        h = torch.rand(lay["nh"], generator=gen).add_(0.1)
        s = torch.randn(lay["ns"], generator=gen)
        if i in nan_at:
            (h if i % 2 else s)[0] = float("nan")
        hs.append(h.to(DEV))
        ss.append(s.to(DEV))
    return hs, ss


def launch_args(layers: list[dict], H: list, S: list) -> tuple[list, ...]:
    columns = list(zip(*(lay["scalars"] for lay in layers)))
    return (H, S, [lay["kind"] for lay in layers], [lay["flags"] for lay in layers], *(list(c) for c in columns))


def test_a_kept_launch_updates_as_factor_update_does_and_each_run_reads_its_own_flags(ext):  # noqa: F811
    gen = torch.Generator(device="cpu").manual_seed(11)
    L = ext.FACTOR_MAX_LAYERS_PER_LAUNCH * 2 + 3  # (several launches per run)
    layers = random_layers(L, gen)
    H_ref, S_ref = [lay["H"].clone() for lay in layers], [lay["S"].clone() for lay in layers]
    H_kept, S_kept = [lay["H"].clone() for lay in layers], [lay["S"].clone() for lay in layers]
    launch = ext.FactorLaunch(*launch_args(layers, H_kept, S_kept))
    assert len(launch) == L
    unread = []
    for step in range(5):
        nan_at = {step, L // 2 + step, L - 1 - step}
        hs, ss = random_sums(layers, gen, nan_at)
        want = ext.factor_update_(hs, ss, *launch_args(layers, H_ref, S_ref), 0.8, 0.2)
        got = launch.run(ext.TakenSums(hs, ss), 0.8, 0.2)
        assert len(got) == L
        unread.append((got, {i for i, f in enumerate(want.tolist()) if f}))
        if step % 2 == 1:  # read two runs' flags, the newer first: one stayed unread across a run
            for flags, nan in reversed(unread):
                assert {i for i, f in enumerate(flags.values()) if f} == nan
                assert flags.ready()
            unread = []
        for i in range(L):
            assert torch.equal(H_kept[i], H_ref[i]) and torch.equal(S_kept[i], S_ref[i]), f"step {step}, layer {i}"
    for flags, nan in unread:
        assert {i for i, f in enumerate(flags.values()) if f} == nan
        assert flags.values() == flags.values()  # (read again: the host copy)


def test_a_kept_launch_refuses_what_does_not_fit_its_layers(ext):  # noqa: F811
    gen = torch.Generator(device="cpu").manual_seed(3)
    layers = random_layers(4, gen)
    launch = ext.FactorLaunch(*launch_args(layers, [lay["H"] for lay in layers], [lay["S"] for lay in layers]))
    hs, ss = random_sums(layers, gen, set())
    with pytest.raises(RuntimeError, match="FactorLaunch: the taken sums have 3 layers, the launch 4"):
        launch.run(ext.TakenSums(hs[:3], ss[:3]), 0.8, 0.2)
    assert layers[0]["kind"] == 0  # (h's length is fixed by H's)
    longer, as_double, s_on_cpu = [torch.cat([hs[0], hs[0]])], [hs[0].double()], [ss[0].cpu()]
    for bad_h, bad_s in ((longer + hs[1:], ss), (as_double + hs[1:], ss), (hs, s_on_cpu + ss[1:])):
        with pytest.raises(RuntimeError, match="FactorLaunch: layer 0's sums do not fit its factors"):
            launch.run(ext.TakenSums(bad_h, bad_s), 0.8, 0.2)
    args = launch_args(layers, [lay["H"] for lay in layers], [lay["S"] for lay in layers])
    with pytest.raises(RuntimeError, match="FactorLaunch: H\\[0\\] must be a CUDA tensor"):
        ext.FactorLaunch([args[0][0].cpu()] + args[0][1:], *args[1:])
    with pytest.raises(RuntimeError, match="FactorLaunch: kinds\\[1\\] must be 0 or 1, got 2"):
        ext.FactorLaunch(args[0], args[1], [args[2][0], 2] + args[2][2:], *args[3:])
    with pytest.raises(RuntimeError, match="FactorLaunch: every list must have one entry per layer"):
        ext.FactorLaunch(args[0], args[1][:3], *args[2:])


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # (nothing was captured: the point)
def test_a_kept_launch_is_not_captured_into_a_cuda_graph(ext):  # noqa: F811
    """Its NaN flags are read on the host: on a stream being captured it raises, naming why,
    before launching anything."""
    gen = torch.Generator(device="cpu").manual_seed(4)
    layers = random_layers(3, gen)
    H = [lay["H"].clone() for lay in layers]
    launch = ext.FactorLaunch(*launch_args(layers, H, [lay["S"].clone() for lay in layers]))
    taken = ext.TakenSums(*random_sums(layers, gen, set()))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="being captured into a CUDA graph"):
                launch.run(taken, 0.8, 0.2)
        finally:
            graph.capture_end()
    assert all(torch.equal(a, lay["H"]) for a, lay in zip(H, layers))  # nothing ran
