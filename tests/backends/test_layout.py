"""Dense layouts in the fused step: F indexed through the memory order, checked on the CPU.

The kernel reads ``F[f] = S[f // ncols] * H[off + f % ncols] + Lambda`` over a flat row.
A stand-in extension doing exactly that in torch, fed what ``FusedBackend`` plans,
must equal the oracle on channels_last (and other dense, dim-0-outermost) parameters.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.backends.base import FactorView, StepBatch
from lightning_cafin.backends.fused import FusedBackend
from lightning_cafin.backends.layout import (MemoryOrderCopies, channels_innermost, dense_in_memory, layout_reason,
                                             memory_columns)

D = torch.float64


def flat(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view of a dense tensor's storage span, in memory order (as the kernel walks it)."""
    return t.as_strided((t.numel(),), (1,))


def in_memory_order(view: FactorView, p: torch.Tensor) -> torch.Tensor:
    """The logical F of ``view`` laid out as ``p``, read flat in memory order."""
    laid_out = torch.empty_like(p)
    laid_out.copy_(view.fisher(1e-3, p.shape))
    return flat(laid_out)


def kernel_fisher(S, H_mem, col_offset, ncols, Lambda, numel, inner=1):
    """What the kernel computes for a flat parameter of ``numel`` elements (``inner`` = C > 1:
    stored channels innermost, memory column ``k * C + c`` reading column ``c * ncols / C + k``)."""
    f = torch.arange(numel)
    m = f % ncols
    col = m if inner == 1 else (m % inner) * (ncols // inner) + m // inner
    return S[f // ncols] * H_mem[col_offset + col] + Lambda


LAYOUTS = {
    "channels_last": lambda: torch.randn(6, 4, 3, 2, dtype=D).contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda: torch.randn(5, 3, 2, 3, 2, dtype=D).contiguous(memory_format=torch.channels_last_3d),
    "permuted_inner_dims": lambda: torch.randn(4, 5, 3, dtype=D).permute(0, 2, 1),  # (channels innermost, as a Conv1d's)
    "swapped_middle_dims": lambda: torch.randn(4, 3, 5, 2, dtype=D).permute(0, 2, 1, 3),  # dense, dim 0 outermost
    "contiguous": lambda: torch.randn(5, 3, 2, dtype=D),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_permuted_columns_give_the_logical_fisher_in_memory_order(layout):
    """Two parameters' copies (one at an offset into its H, beside a bias column) made as one
    buffer: each gives the logical F read in memory order, and again once their factors
    were rewritten in place and the copies refreshed (in place)."""
    p, other = LAYOUTS[layout](), LAYOUTS["channels_last"]()
    rows, ncols = p.shape[0], p.numel() // p.shape[0]
    S = torch.rand(rows, dtype=D)
    H = torch.rand(ncols + 1, dtype=D)  # a bias column after the weight's, as a conv layer has
    H2 = torch.rand(other.numel() // other.shape[0] + 3, dtype=D)  # the other's segment from column 3
    copies = MemoryOrderCopies()
    copies.add(H, 0, memory_columns(p))
    copies.add(H2, 3, memory_columns(other))
    H_mem, H2_mem = copies.copies()
    assert layout_reason(p) is None and len(copies) == 2
    assert H_mem.shape == (ncols,)  # the weight's segment alone (the bias column is not its)
    assert H_mem.untyped_storage().data_ptr() == H2_mem.untyped_storage().data_ptr()  # one buffer
    S2 = torch.rand(other.shape[0], dtype=D)
    n2 = other.numel() // other.shape[0]

    def assert_logical():
        assert torch.equal(kernel_fisher(S, H_mem, 0, ncols, 1e-3, p.numel()), in_memory_order(FactorView(S, H, 0, ncols), p))
        assert torch.equal(kernel_fisher(S2, H2_mem, 0, n2, 1e-3, other.numel()),
                           in_memory_order(FactorView(S2, H2, 3, n2), other))

    assert_logical()
    if layout == "contiguous":
        assert torch.equal(H_mem, H[:ncols])
    H.uniform_()  # a capture step rewrites the factors in place
    H2.uniform_()
    before = H_mem.data_ptr()
    copies.refresh()
    assert H_mem.data_ptr() == before
    assert_logical()
    one = MemoryOrderCopies()  # a single parameter gathers straight from its segment
    one.add(H2, 3, memory_columns(other))
    (alone,) = one.copies()
    assert torch.equal(alone, H2_mem)
    with pytest.raises(RuntimeError, match="add every parameter first"):
        copies.add(H, 0, memory_columns(p))


@pytest.mark.parametrize("layout, inner", [("channels_last", 4), ("channels_last_3d", 3), ("permuted_inner_dims", 3),
                                           ("swapped_middle_dims", 1), ("contiguous", 1)])
def test_channels_innermost_layouts_map_their_columns_in_the_kernel(layout, inner):
    """channels_last and channels_last_3d weights are read through ``inner`` = C: memory
    column ``k * C + c`` gives the logical F, no copy of H; other orders take the copy."""
    p = LAYOUTS[layout]()
    assert channels_innermost(p) == inner
    rows, ncols = p.shape[0], p.numel() // p.shape[0]
    S, H = torch.rand(rows, dtype=D), torch.rand(ncols + 2, dtype=D)
    if inner > 1:
        assert torch.equal(kernel_fisher(S, H, 1, ncols, 1e-3, p.numel(), inner), in_memory_order(FactorView(S, H, 1, ncols), p))
    cl1x1 = torch.randn(6, 4, 1, 1).contiguous(memory_format=torch.channels_last)
    assert cl1x1.is_contiguous() and channels_innermost(cl1x1) == 1  # (a 1 x 1 kernel's layout is the contiguous one)
    one_channel = torch.randn(6, 1, 3, 3).contiguous(memory_format=torch.channels_last)
    assert channels_innermost(one_channel) == 1


def test_the_plan_reads_channels_last_factors_in_place_and_copies_only_other_orders():
    cl = torch.randn(6, 4, 3, 2).contiguous(memory_format=torch.channels_last)
    permuted = torch.randn(4, 3, 5, 2).permute(0, 2, 1, 3)
    views = [FactorView(torch.rand(6), torch.rand(25), 0, 24), FactorView(torch.rand(4), torch.rand(31), 1, 30)]
    params = [cl, permuted]
    batch = StepBatch(params, [torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params],
                      [torch.zeros(()) for _ in params], views, 0)
    (group,) = CpuFused().prepare(batch)
    assert group.inners == [4, 1] and len(group.permuted) == 1  # the permuted view alone takes a copy
    assert group.H[0] is views[0].H and group.col_offsets[0] == 0  # read where it is
    assert group.H[1] is not views[1].H and group.col_offsets[1] == 0  # its memory-ordered copy


def test_layouts_the_kernel_cannot_walk_are_named():
    w = torch.randn(4, 5)
    assert "dim 0 outermost" in layout_reason(w.t()) and "contiguous" in layout_reason(w.t())
    assert "not dense" in layout_reason(torch.randn(4, 10)[:, ::2])
    cl = torch.randn(6, 4, 3, 2).contiguous(memory_format=torch.channels_last)
    assert layout_reason(cl, torch.randn(6, 4, 3, 2)) .startswith("its gradient is not contiguous alike")
    assert layout_reason(cl, torch.randn_like(cl)) is None  # randn_like preserves the layout


class StandInExtension:
    """``adafisher_step_`` as the kernel computes it, in torch, with the op's layout checks:
    every tensor dense, the gradient and momentum laid out as the parameter, all three
    walked flat in memory order."""

    def adafisher_step_(self, params, grads, exp_avgs, steps, S_list, H_list, col_offsets, ncols, inners, lr, beta,
                        Lambda, wd, decoupled, grad_scale, found_inf, lr_tensor):
        if found_inf is not None and found_inf.item() != 0:
            return
        assert len(inners) == len(params)
        for p, g, m, k, S, H, off, nc, inner in zip(params, grads, exp_avgs, steps, S_list, H_list, col_offsets, ncols,
                                                    inners):
            assert p.is_contiguous() or dense_in_memory(p), "the op refuses a param that is not dense"
            assert inner == 1 or (S is not None and channels_innermost(p) == inner and S.numel() == p.shape[0]), \
                "the op refuses an inner count the parameter's strides do not show"
            for name, t in (("grad", g), ("exp_avg", m)):
                alike = t.is_contiguous() if p.is_contiguous() else t.stride() == p.stride()
                assert alike and t.shape == p.shape, f"the op refuses a {name} laid out unlike its param"
            g = flat(g) / grad_scale if grad_scale is not None else flat(g)
            pf, mf = flat(p), flat(m)
            k += 1
            bc = 1 - beta ** float(k)
            F = torch.ones_like(pf) if S is None else kernel_fisher(S, H, off, nc, Lambda, pf.numel(), inner).to(pf.dtype)
            if decoupled:
                mf.mul_(beta).add_(g, alpha=1 - beta)
                pf.sub_(lr * (mf / bc / F + wd * pf))
            else:
                g = g.add(pf, alpha=wd) if wd else g
                mf.mul_(beta).add_(g, alpha=1 - beta)
                pf.addcdiv_(mf, F, value=-(lr / bc))


class CpuFused(FusedBackend):
    """The fused backend's planning on the CPU, over the stand-in extension."""

    def __init__(self) -> None:
        self._ext = StandInExtension()
        self.momentum_dtype = None

    def unsupported_reason(self, param, grad=None):
        return layout_reason(param, grad)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 4, (3, 2), groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.c2(torch.tanh(self.c1(x))))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
def test_channels_last_parameters_are_stepped_in_place_and_equal_the_oracle(opt_cls):
    model = ConvNet().to(memory_format=torch.channels_last)  # float32: the factors the kernel takes
    twin = copy.deepcopy(model)
    assert not model.c1.weight.is_contiguous()
    opt = opt_cls(model, TCov=3, weight_decay=1e-2, backend="foreach")
    opt.set_backend(CpuFused())
    ref = opt_cls(twin, TCov=3, weight_decay=1e-2, backend="reference")
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: every tensor goes to the (stand-in) kernel
        for _ in range(10):  # over three capture steps
            x = torch.randn(4, 3, 7, 6, generator=gen).contiguous(memory_format=torch.channels_last)
            for o, m in ((opt, model), (ref, twin)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
    assert opt.state[model.c1.weight]["exp_avg"].stride() == model.c1.weight.stride()
    assert model.c1.weight.stride() == twin.c1.weight.stride()  # updated in place, layout kept
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert opt.health["capture_steps"] == ref.health["capture_steps"] == 4
