"""The fused CUDA step against the reference oracle (GPU only).

Inputs are always fresh and random (parameters, gradients, momentum, factors and
step counts; factors positive like real ones), the oracle is
``ReferenceBackend`` on identical copies.  fp32 must agree to 1e-6 relative (to the
tensor's scale) per step and after 250 steps; fp16/bf16 are compared one step at a
time against the oracle run in fp32 on the upcast state, within one rounding of
the low-precision dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import Tensor

from lightning_cafin.backends.base import FactorView, StepBatch, StepHyper

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused step needs a CUDA device"),
]

DEV = "cuda"
LR, BETA, LAMBDA = 1e-3, 0.9, 1e-3
FP32_RTOL = 1e-6
# One rounding to the storage dtype (half an ulp), with room for one more ulp.
LOWP_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture
def oracle():
    from lightning_cafin.backends.reference import ReferenceBackend

    return ReferenceBackend()


def fused(momentum_dtype=None):
    from lightning_cafin.backends.fused import FusedBackend

    return FusedBackend(momentum_dtype=momentum_dtype)


# --------------------------------------------------------------------------- data


def factors(n: int) -> Tensor:
    return torch.empty(n, device=DEV).uniform_(0.01, 0.1)


def layer_zoo() -> list[tuple[tuple, Optional[FactorView]]]:
    """(shape, view) for every kind of parameter the optimizer produces."""
    items: list[tuple[tuple, Optional[FactorView]]] = []
    S, H = factors(19), factors(38)  # Linear(37 -> 19) with bias: sizes not multiples of 4
    items += [((19, 37), FactorView(S, H, 0, 37)), ((19,), FactorView(S, H, 37, 1))]
    S, H = factors(16), factors(8 * 9 + 1)  # Conv2d(8 -> 16, 3x3) with bias
    items += [((16, 8, 3, 3), FactorView(S, H, 0, 72)), ((16,), FactorView(S, H, 72, 1))]
    S, H = factors(6), factors(3 * 25)  # Conv2d(3 -> 6, 5x5), no bias
    items += [((6, 3, 5, 5), FactorView(S, H, 0, 75))]
    S, H = factors(13), factors(2)  # BatchNorm2d(13): weight column 0, bias column 1
    items += [((13,), FactorView(S, H, 0, 1)), ((13,), FactorView(S, H, 1, 1))]
    S, H = factors(10), factors(2)  # LayerNorm(10)
    items += [((10,), FactorView(S, H, 0, 1)), ((10,), FactorView(S, H, 1, 1))]
    S, H = factors(5), factors(7)  # Linear(7 -> 5), no bias: 35 elements
    items += [((5, 7), FactorView(S, H, 0, 7))]
    items += [((50, 7), None), ((), None), ((3,), None), ((1,), None)]  # F = 1
    return items


def big_zoo() -> list[tuple[tuple, Optional[FactorView]]]:
    """Tensors spanning several step chunks (16K elements), rows crossing chunk boundaries."""
    S, H = factors(300), factors(701)  # Linear(700 -> 300) with bias: 210000 elements
    return [
        ((300, 700), FactorView(S, H, 0, 700)),
        ((300,), FactorView(S, H, 700, 1)),
        ((70001,), None),
        ((3, 65536), FactorView(factors(3), factors(65536), 0, 65536)),
    ]


def buffer_view(shape: tuple, dtype: torch.dtype, offset: int) -> Tensor:
    """A contiguous tensor of ``shape`` that starts ``offset`` elements into a bigger buffer."""
    numel = math.prod(shape)
    buf = torch.empty(numel + offset + 5, device=DEV, dtype=dtype)
    return buf[offset : offset + numel].view(shape)


def rand_like_into(t: Tensor, kind: str) -> Tensor:
    src = torch.empty(t.shape, device=DEV, dtype=torch.float32)
    if kind == "param":
        src.uniform_(-1.0, 1.0)
    elif kind == "grad":
        src.normal_()
    else:  # momentum
        src.normal_(0.0, 0.3)
    src[src == 0] = 0.25  # never an exact zero
    t.copy_(src)
    return t


@dataclass
class Problem:
    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    steps: list[Tensor]
    views: list[Optional[FactorView]]

    def batch(self, version: int = 0) -> StepBatch:
        return StepBatch(self.params, self.grads, self.exp_avgs, self.steps, self.views, version)

    def copy(self, dtype: Optional[torch.dtype] = None, momentum_dtype: Optional[torch.dtype] = None) -> "Problem":
        """Fresh contiguous copies (optionally converted); the views are shared."""

        def cp(t: Tensor, dt: Optional[torch.dtype]) -> Tensor:
            return t.detach().to(dtype=dt or t.dtype, copy=True).contiguous()

        return Problem(
            [cp(p, dtype) for p in self.params],
            [cp(g, dtype) for g in self.grads],
            [cp(m, momentum_dtype or dtype) for m in self.exp_avgs],
            [s.detach().clone() for s in self.steps],
            list(self.views),
        )

    def tensors(self) -> list[Tensor]:
        return self.params + self.exp_avgs + self.steps


def make_problem(
    items,
    dtype: torch.dtype = torch.float32,
    momentum_dtype: Optional[torch.dtype] = None,
    offsets: tuple[int, int, int] = (0, 0, 0),
    step_choices=(0.0, 1.0, 7.0, 40.0),
) -> Problem:
    mdt = momentum_dtype or dtype
    prob = Problem([], [], [], [], [])
    for i, (shape, view) in enumerate(items):
        po, go, mo = offsets
        prob.params.append(rand_like_into(buffer_view(shape, dtype, po), "param"))
        prob.grads.append(rand_like_into(buffer_view(shape, dtype, go), "grad"))
        prob.exp_avgs.append(rand_like_into(buffer_view(shape, mdt, mo), "momentum"))
        prob.steps.append(torch.full((), step_choices[i % len(step_choices)], device=DEV))
        prob.views.append(view)
    return prob


def new_grads(prob: Problem) -> list[Tensor]:
    return [rand_like_into(torch.empty_like(g), "grad") for g in prob.grads]


def assert_close_scaled(actual: Tensor, expected: Tensor, rtol: float, what: str = "") -> None:
    """Elementwise within rtol, where the absolute slack is rtol times the tensor's scale."""
    a, e = actual.double(), expected.double()
    scale = e.abs().max().item() if e.numel() else 0.0
    torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


def assert_problem_close(got: Problem, want: Problem, rtol: float) -> None:
    for i, (p, q) in enumerate(zip(got.params, want.params)):
        assert_close_scaled(p, q, rtol, f"param {i} {tuple(p.shape)}")
    for i, (m, n) in enumerate(zip(got.exp_avgs, want.exp_avgs)):
        assert_close_scaled(m, n, rtol, f"exp_avg {i} {tuple(m.shape)}")
    for i, (s, t) in enumerate(zip(got.steps, want.steps)):
        assert s.device.type == "cuda"
        assert s.item() == t.item(), f"step {i}"


def hyper(decoupled: bool, wd: float) -> StepHyper:
    return StepHyper(lr=LR, beta=BETA, Lambda=LAMBDA, weight_decay=wd, decoupled=decoupled)


ALGOS = [
    pytest.param(False, 0.0, id="adafisher"),
    pytest.param(False, 0.1, id="adafisher-l2"),
    pytest.param(True, 0.0, id="adafisherw"),
    pytest.param(True, 0.1, id="adafisherw-decay"),
]


# --------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("decoupled, wd", ALGOS)
def test_fp32_one_step_matches_reference(ext, oracle, decoupled, wd):
    prob = make_problem(layer_zoo() + big_zoo())
    ref = prob.copy()
    h = hyper(decoupled, wd)
    fused().step(prob.batch(), h)
    oracle.step(ref.batch(), h)
    assert_problem_close(prob, ref, FP32_RTOL)


@pytest.mark.parametrize("decoupled, wd", ALGOS)
def test_fp32_250_steps_match_reference(ext, oracle, decoupled, wd):
    prob = make_problem(layer_zoo() + big_zoo())
    ref = prob.copy()
    h = hyper(decoupled, wd)
    backend = fused()
    for _ in range(250):
        grads = new_grads(prob)
        prob.grads[:] = grads
        ref.grads[:] = grads  # neither backend writes the gradients
        backend.step(prob.batch(), h)
        oracle.step(ref.batch(), h)
    assert_problem_close(prob, ref, FP32_RTOL)


@pytest.mark.parametrize("offsets", [(1, 0, 0), (0, 3, 0), (0, 0, 2), (1, 2, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unaligned_storage_offsets(ext, oracle, offsets, dtype):
    """Tensors that are slices of bigger buffers take the scalar path and stay exact."""
    prob = make_problem(layer_zoo() + big_zoo(), dtype=dtype, offsets=offsets)
    assert any(t.data_ptr() % 16 for t in prob.params + prob.grads + prob.exp_avgs)
    h = hyper(False, 0.1)
    if dtype == torch.float32:
        ref = prob.copy()
        fused().step(prob.batch(), h)
        oracle.step(ref.batch(), h)
        assert_problem_close(prob, ref, FP32_RTOL)
    else:
        # The same data in aligned storage goes through the vector path: bitwise equal.
        aligned = prob.copy()
        assert all(t.data_ptr() % 16 == 0 for t in aligned.params + aligned.grads + aligned.exp_avgs)
        fused().step(prob.batch(), h)
        fused().step(aligned.batch(), h)
        for a, b in zip(prob.tensors(), aligned.tensors()):
            assert torch.equal(a, b)


def test_many_tensors_exceed_launch_capacity(ext, oracle):
    gen = torch.Generator().manual_seed(7)
    items = []
    for i in range(ext.MAX_TENSORS_PER_LAUNCH + 52):
        rows = int(torch.randint(1, 40, (1,), generator=gen))
        cols = int(torch.randint(1, 40, (1,), generator=gen))
        if i % 3 == 2:
            items.append(((rows, cols), None))
        else:
            items.append(((rows, cols), FactorView(factors(rows), factors(cols + 3), 2, cols)))
    items += big_zoo()
    # tensors of several chunks in the last slot of one launch and the first of the next
    chunked = multi_chunk_item(ext)
    items[ext.MAX_TENSORS_PER_LAUNCH - 1: ext.MAX_TENSORS_PER_LAUNCH + 1] = [chunked, chunked]
    assert len(items) > ext.MAX_TENSORS_PER_LAUNCH
    assert len(items) > ext.MAX_STEPS_PER_INCREMENT_LAUNCH
    prob = make_problem(items)
    ref = prob.copy()
    h = hyper(True, 0.05)
    backend = fused()
    for _ in range(3):
        grads = new_grads(prob)
        prob.grads[:] = grads
        ref.grads[:] = grads
        backend.step(prob.batch(), h)
        oracle.step(ref.batch(), h)
    assert_problem_close(prob, ref, FP32_RTOL)


def multi_chunk_item(ext) -> tuple[tuple, FactorView]:
    """A Linear weight of several step chunks whose rows cross chunk boundaries."""
    rows, cols = 5, 2 * ext.CHUNK_SIZE + 3
    return (rows, cols), FactorView(factors(rows), factors(cols + 1), 1, cols)


def launch_boundary_zoo(ext) -> list[tuple[tuple, Optional[FactorView]]]:
    """More tensors than one launch holds (and than one counter launch holds), tensors
    of several chunks in the last slot of a launch and the first of the next, and empty
    tensors between them (skipped by the step launches, counted by the increments)."""
    gen = torch.Generator().manual_seed(11)
    items: list[tuple[tuple, Optional[FactorView]]] = []
    stepped = 0  # non-empty tensors so far: the step launches' slots
    for i in range(max(ext.MAX_STEPS_PER_INCREMENT_LAUNCH, ext.MAX_TENSORS_PER_LAUNCH) + 20):
        if i % 97 == 5:
            items.append(((0,), None))
            continue
        if stepped % ext.MAX_TENSORS_PER_LAUNCH in (ext.MAX_TENSORS_PER_LAUNCH - 1, 0) or i % 61 == 7:
            items.append(multi_chunk_item(ext))
        else:
            rows = int(torch.randint(1, 30, (1,), generator=gen))
            cols = int(torch.randint(1, 30, (1,), generator=gen))
            view = None if i % 4 == 3 else FactorView(factors(rows), factors(cols + 1), 1, cols)
            items.append(((rows, cols), view))
        stepped += 1
    return items


LAUNCH_DTYPES = [
    pytest.param(torch.float32, None, id="fp32"),
    pytest.param(torch.bfloat16, None, id="bf16-m-lowp"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-m-fp32"),
    pytest.param(torch.float16, None, id="fp16-m-lowp"),
    pytest.param(torch.float16, torch.float32, id="fp16-m-fp32"),
]


def step_op(ext, prob: Problem, lo: int, hi: int, decoupled: bool, **scalars) -> None:
    """The extension op on tensors [lo, hi) of prob (lr 2^-10, exact in fp32)."""
    views = prob.views[lo:hi]
    ext.adafisher_step_(
        prob.params[lo:hi], prob.grads[lo:hi], prob.exp_avgs[lo:hi], prob.steps[lo:hi],
        [v.S if v else None for v in views], [v.H if v else None for v in views],
        [v.col_offset if v else 0 for v in views], [v.ncols if v else 1 for v in views], [1] * len(views),
        lr=2.0**-10, beta=BETA, Lambda=LAMBDA, weight_decay=0.05, decoupled=decoupled, **scalars,
    )


@pytest.mark.parametrize("dtype, momentum_dtype", LAUNCH_DTYPES)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adafisher", "adafisherw"])
def test_launch_splitting_is_bitwise_invisible(ext, dtype, momentum_dtype, decoupled):
    """One call over every tensor (several launches, tensors of several chunks on both
    sides of a launch boundary, the lr and found_inf read on the device) equals one call
    per tensor (one launch each, a float lr, no found_inf) bit for bit, in every dtype
    instantiation of the kernel."""
    whole = make_problem(launch_boundary_zoo(ext), dtype=dtype, momentum_dtype=momentum_dtype)
    assert len(whole.params) > ext.MAX_STEPS_PER_INCREMENT_LAUNCH
    assert sum(p.numel() > 0 for p in whole.params) > ext.MAX_TENSORS_PER_LAUNCH
    apart = whole.copy()
    gs = torch.full((), 4.0, device=DEV)
    for _ in range(2):
        step_op(ext, whole, 0, len(whole.params), decoupled, grad_scale=gs,
                found_inf=torch.zeros((), device=DEV), lr_tensor=torch.full((), 2.0**-10, device=DEV))
        for i in range(len(apart.params)):
            step_op(ext, apart, i, i + 1, decoupled, grad_scale=gs)
    torch.cuda.synchronize()
    for i, (x, y) in enumerate(zip(whole.tensors(), apart.tensors())):
        assert torch.equal(x, y), f"tensor {i} of {len(whole.params)} params"


def test_found_inf_skips_every_launch(ext):
    """found_inf reaches every step launch and every counter launch of a long list."""
    prob = make_problem(launch_boundary_zoo(ext), dtype=torch.bfloat16, momentum_dtype=torch.float32)
    before = [t.clone() for t in prob.tensors()]
    step_op(ext, prob, 0, len(prob.params), True, found_inf=torch.ones((), device=DEV))
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(prob.tensors(), before)):
        assert torch.equal(a, b), f"tensor {i}"


def test_empty_parameter_still_counts_its_step(ext):
    prob = make_problem([((0,), None), ((0, 4), None), ((5,), None)])
    fused().step(prob.batch(), hyper(False, 0.0))
    assert [s.item() for s in prob.steps] == [1.0, 2.0, 8.0]


# ----------------------------------------------------------------- fp16 / bf16


@pytest.mark.parametrize("momentum_fp32", [False, True], ids=["m-lowp", "m-fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled, wd", ALGOS)
def test_low_precision_each_step_matches_fp32_reference(ext, oracle, dtype, momentum_fp32, decoupled, wd):
    mdt = torch.float32 if momentum_fp32 else None
    prob = make_problem(layer_zoo() + big_zoo(), dtype=dtype, momentum_dtype=mdt)
    backend = fused(momentum_dtype=mdt)
    h = hyper(decoupled, wd)
    rtol = LOWP_RTOL[dtype]
    for _ in range(5):
        prob.grads[:] = new_grads(prob)
        ref = prob.copy(dtype=torch.float32, momentum_dtype=torch.float32)
        backend.step(prob.batch(), h)
        oracle.step(ref.batch(), h)
        for i, (p, q) in enumerate(zip(prob.params, ref.params)):
            assert p.dtype == dtype
            assert_close_scaled(p.float(), q, rtol, f"param {i}")
        for i, (m, n) in enumerate(zip(prob.exp_avgs, ref.exp_avgs)):
            assert m.dtype == (torch.float32 if momentum_fp32 else dtype)
            assert_close_scaled(m.float(), n, FP32_RTOL if momentum_fp32 else rtol, f"exp_avg {i}")
        assert [s.item() for s in prob.steps] == [s.item() for s in ref.steps]


# ------------------------------------------------------------- AMP contract


def test_grad_scale_divides_gradients(ext, oracle):
    prob = make_problem(layer_zoo() + big_zoo())
    ref = prob.copy()
    scale = 1024.0  # a power of two: g * s / s is exact
    prob.grads[:] = [g * scale for g in prob.grads]
    gs = torch.full((), scale, device=DEV)
    fi = torch.zeros((), device=DEV)
    h = hyper(False, 0.1)
    fused().step(prob.batch(), h, grad_scale=gs, found_inf=fi)
    oracle.step(ref.batch(), h)
    assert_problem_close(prob, ref, FP32_RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_scale_divides_low_precision_gradients(ext, oracle, dtype):
    prob = make_problem(layer_zoo() + big_zoo(), dtype=dtype, momentum_dtype=torch.float32)
    ref = prob.copy(dtype=torch.float32, momentum_dtype=torch.float32)
    scale = 256.0  # a power of two: exact in every dtype here
    prob.grads[:] = [g * scale for g in prob.grads]
    h = hyper(False, 0.1)
    fused(momentum_dtype=torch.float32).step(prob.batch(), h, grad_scale=torch.full((), scale, device=DEV))
    oracle.step(ref.batch(), h)
    for i, (p, q) in enumerate(zip(prob.params, ref.params)):
        assert_close_scaled(p.float(), q, LOWP_RTOL[dtype], f"param {i}")
    for i, (m, n) in enumerate(zip(prob.exp_avgs, ref.exp_avgs)):
        assert_close_scaled(m, n, FP32_RTOL, f"exp_avg {i}")


def test_found_inf_changes_nothing(ext):
    prob = make_problem(layer_zoo() + big_zoo())
    before = [t.clone() for t in prob.tensors()]
    fi = torch.ones((), device=DEV)
    backend = fused()
    for decoupled in (False, True):
        backend.step(prob.batch(), hyper(decoupled, 0.1), grad_scale=torch.full((), 8.0, device=DEV), found_inf=fi)
    fi.fill_(float("nan"))  # nonzero too
    backend.step(prob.batch(), hyper(False, 0.0), found_inf=fi)
    torch.cuda.synchronize()
    for a, b in zip(prob.tensors(), before):
        assert torch.equal(a, b)


def test_found_inf_zero_equals_no_found_inf(ext):
    a = make_problem(layer_zoo())
    b = a.copy()
    h = hyper(True, 0.1)
    fused().step(a.batch(), h, found_inf=torch.zeros((), device=DEV))
    fused().step(b.batch(), h)
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y)


# ------------------------------------------------------------- lr as a tensor


@pytest.mark.parametrize("decoupled, wd", ALGOS)
def test_lr_tensor_equals_float_lr(ext, decoupled, wd):
    lr = 2.0**-10  # exact in fp32, so the two paths must agree bit for bit
    a = make_problem(layer_zoo() + big_zoo())
    b = a.copy()
    h_float = StepHyper(lr=lr, beta=BETA, Lambda=LAMBDA, weight_decay=wd, decoupled=decoupled)
    h_tensor = StepHyper(
        lr=torch.full((), lr, device=DEV), beta=BETA, Lambda=LAMBDA, weight_decay=wd, decoupled=decoupled
    )
    for _ in range(3):
        grads = new_grads(a)
        a.grads[:] = grads
        b.grads[:] = [g.clone() for g in grads]
        fused().step(a.batch(), h_float)
        fused().step(b.batch(), h_tensor)
    for i, (x, y) in enumerate(zip(a.tensors(), b.tensors())):
        assert torch.equal(x, y), f"tensor {i}"


def test_graph_replay_reads_lr_tensor_after_fill(ext):
    """A scheduler's in-place ``fill_`` of a tensor lr reaches a captured step."""
    eager = make_problem(layer_zoo())
    graphed = eager.copy()
    lr_t = torch.full((), 2.0**-8, device=DEV)
    backend = fused()
    h_graph = StepHyper(lr=lr_t, beta=BETA, Lambda=LAMBDA, weight_decay=0.1, decoupled=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.step(graphed.batch(), h_graph)  # warm-up, mirrored on the eager copy
    torch.cuda.current_stream().wait_stream(side)
    fused().step(eager.batch(), StepHyper(2.0**-8, BETA, LAMBDA, 0.1, True))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.step(graphed.batch(), h_graph)
    for r, lr in enumerate((2.0**-9, 2.0**-12, 0.0, 2.0**-7)):
        lr_t.fill_(lr)
        grads = new_grads(eager)
        for static, g in zip(graphed.grads, grads):
            static.copy_(g)
        eager.grads[:] = grads
        graph.replay()
        fused().step(eager.batch(), StepHyper(lr, BETA, LAMBDA, 0.1, True))
        torch.cuda.synchronize()
        for x, y in zip(graphed.tensors(), eager.tensors()):
            assert torch.equal(x, y), f"replay {r} with lr {lr}"


# ------------------------------------------------------- graphs, allocations


def test_cuda_graph_capture_and_replay_equal_eager(ext):
    eager = make_problem(layer_zoo() + big_zoo())
    graphed = eager.copy()
    gs = torch.full((), 4.0, device=DEV)
    fi = torch.zeros((), device=DEV)
    h = hyper(False, 0.1)
    b_eager, b_graph = fused(), fused()

    # Warm-up on a side stream (one real step on both copies keeps them equal).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b_graph.step(graphed.batch(), h, gs, fi)
    torch.cuda.current_stream().wait_stream(side)
    b_eager.step(eager.batch(), h, gs, fi)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b_graph.step(graphed.batch(), h, gs, fi)

    for r in range(6):
        grads = new_grads(eager)
        for static, g in zip(graphed.grads, grads):
            static.copy_(g)
        eager.grads[:] = grads
        skip = r == 3
        fi.fill_(1.0 if skip else 0.0)
        graph.replay()
        b_eager.step(eager.batch(), h, gs, fi)
        torch.cuda.synchronize()
        for x, y in zip(graphed.tensors(), eager.tensors()):
            assert torch.equal(x, y), f"replay {r}"
    # Steps advanced on the device through the replays: 1 warm-up + 5 applied.
    assert [s.item() for s in graphed.steps] == [s.item() for s in eager.steps]
    assert graphed.steps[0].item() == 0.0 + 6


def test_step_allocates_nothing(ext):
    prob = make_problem(layer_zoo() + big_zoo(), dtype=torch.bfloat16, momentum_dtype=torch.float32)
    backend = fused(momentum_dtype=torch.float32)
    gs = torch.full((), 2.0, device=DEV)
    fi = torch.zeros((), device=DEV)
    h = hyper(True, 0.1)
    backend.step(prob.batch(), h, gs, fi)  # warm-up (fills the Python-side cache)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        backend.step(prob.batch(), h, gs, fi)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_steps_advance_on_device(ext):
    prob = make_problem(layer_zoo(), step_choices=(0.0, 5.0))
    start = [s.item() for s in prob.steps]
    backend = fused()
    for _ in range(3):
        backend.step(prob.batch(), hyper(False, 0.0))
    for s, k in zip(prob.steps, start):
        assert s.is_cuda and s.dtype == torch.float32
        assert s.item() == k + 3


# --------------------------------------------------------------- > 2^31 elements


def test_tensor_larger_than_int32(ext, oracle):
    numel = 2**31 + 65536 + 7
    need = numel * (2 * 3 + 4) + (1 << 30)  # bf16 p, g, m + fp32 S
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    dtype = torch.bfloat16
    p = torch.empty(numel, device=DEV, dtype=dtype).uniform_(-1, 1)
    g = torch.empty(numel, device=DEV, dtype=dtype).normal_()
    m = torch.empty(numel, device=DEV, dtype=dtype).normal_(0, 0.3)
    S = torch.empty(numel, device=DEV).uniform_(0.01, 0.1)  # ncols = 1: rows go past 2^31
    H = factors(1)
    k = torch.full((), 2.0, device=DEV)
    windows = [(0, 70000), (2**31 - 40000, 2**31 + 40000), (numel - 70000, numel)]
    saved = [(p[a:b].float(), g[a:b].float(), m[a:b].float()) for a, b in windows]
    h = hyper(False, 0.1)
    fused().step(StepBatch([p], [g], [m], [k], [FactorView(S, H, 0, 1)]), h)
    assert k.item() == 3.0
    rtol = LOWP_RTOL[dtype]
    for (a, b), (p0, g0, m0) in zip(windows, saved):
        kk = torch.full((), 2.0, device=DEV)
        oracle.step(StepBatch([p0], [g0], [m0], [kk], [FactorView(S[a:b], H, 0, 1)]), h)
        assert_close_scaled(p[a:b].float(), p0, rtol, f"param window {a}")
        assert_close_scaled(m[a:b].float(), m0, rtol, f"exp_avg window {a}")


# ------------------------------------------------------------- state, errors


def test_init_state_puts_step_on_device(ext):
    p = torch.randn(4, 3, device=DEV, dtype=torch.bfloat16)
    state: dict = {}
    fused().init_state(p, state)
    assert state["step"].device == p.device and state["step"].dtype == torch.float32
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].device == p.device
    state32: dict = {}
    fused(momentum_dtype=torch.float32).init_state(p, state32)
    assert state32["exp_avg"].dtype == torch.float32
    # A state made by another backend (CPU step count) is moved, value kept.
    other = {"step": torch.tensor(17.0), "exp_avg": torch.zeros_like(p)}
    fused().init_state(p, other)
    assert other["step"].is_cuda and other["step"].item() == 17.0


def test_clear_errors(ext):
    backend = fused()
    h = hyper(False, 0.0)
    cpu = torch.randn(3)
    with pytest.raises(RuntimeError, match="cpu"):
        backend.step(StepBatch([cpu], [cpu.clone()], [cpu.clone()], [torch.zeros(())], [None]), h)
    p64 = torch.randn(3, device=DEV, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64"):
        backend.step(StepBatch([p64], [p64.clone()], [p64.clone()], [torch.zeros((), device=DEV)], [None]), h)
    p = torch.randn(4, 5, device=DEV)
    k = torch.zeros((), device=DEV)
    with pytest.raises(RuntimeError, match="init_state"):
        backend.step(StepBatch([p], [p.clone()], [p.clone()], [torch.zeros(())], [None]), h)
    with pytest.raises(RuntimeError, match="contiguous"):
        backend.step(StepBatch([p.t()], [p.t().clone()], [p.t().clone()], [k], [None]), h)

    op = ext.adafisher_step_
    args = dict(lr=LR, beta=BETA, Lambda=LAMBDA, weight_decay=0.0, decoupled=False)
    with pytest.raises(RuntimeError, match=r"grads\[0\]"):
        op([p], [torch.randn(5, 4, device=DEV)], [p.clone()], [k], [None], [None], [0], [1], [1], **args)
    with pytest.raises(RuntimeError, match=r"grads\[0\].*contiguous"):
        op([p], [torch.randn(5, 4, device=DEV).t()], [p.clone()], [k], [None], [None], [0], [1], [1], **args)
    w = torch.randn(4, 3, 2, 2, device=DEV).contiguous(memory_format=torch.channels_last)  # dense, not contiguous
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must have the strides of params\[0\]"):
        op([w], [torch.randn_like(w)], [w.contiguous()], [k], [None], [None], [0], [1], [1], **args)
    with pytest.raises(RuntimeError, match=r"params\[0\] must be dense"):
        op([p[:, ::2]], [torch.randn(4, 3, device=DEV)], [p[:, ::2].clone()], [k], [None], [None], [0], [1], [1], **args)
    with pytest.raises(RuntimeError, match=r"grads\[0\]"):
        op([p], [p.clone().half()], [p.clone()], [k], [None], [None], [0], [1], [1], **args)
    with pytest.raises(RuntimeError, match=r"S_list\[0\]"):
        op([p], [p.clone()], [p.clone()], [k], [factors(3)], [factors(5)], [0], [5], [1], **args)
    with pytest.raises(RuntimeError, match=r"col_offsets\[0\]"):
        op([p], [p.clone()], [p.clone()], [k], [factors(4)], [factors(5)], [1], [5], [1], **args)
    with pytest.raises(RuntimeError, match=r"H_list\[0\].*float32"):
        op([p], [p.clone()], [p.clone()], [k], [factors(4)], [factors(5).double()], [0], [5], [1], **args)
    with pytest.raises(RuntimeError, match="found_inf"):
        op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], [1], **args, found_inf=torch.zeros(2, device=DEV))
    with pytest.raises(RuntimeError, match="grad_scale"):
        op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], [1], **args, grad_scale=torch.ones(()))
    with pytest.raises(RuntimeError, match=r"inners\[0\] must be >= 1 and divide ncols\[0\] = 5, got 2"):
        op([p], [p.clone()], [p.clone()], [k], [factors(4)], [factors(5)], [0], [5], [2], **args)
    with pytest.raises(RuntimeError, match=r"params\[0\] is not stored channels innermost with 3 channels"):
        wf = torch.randn(4, 3, 2, 2, device=DEV)  # contiguous: channels outermost in each row
        op([wf], [wf.clone()], [wf.clone()], [k], [factors(4)], [factors(12)], [0], [12], [3], **args)
    with pytest.raises(RuntimeError, match="inners"):
        op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], [], **args)
    with pytest.raises(RuntimeError, match=r"steps\[0\]"):
        op([p], [p.clone()], [p.clone()], [torch.zeros((), device=DEV, dtype=torch.float64)], [None], [None], [0], [1], [1], **args)
