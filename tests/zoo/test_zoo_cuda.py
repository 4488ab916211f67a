"""The zoo on a GPU (float32, the small configs of ``models.py``), stepped by the fused kernel.

Per model:

* ``fused`` against ``foreach`` from the same weights and batches, TCov=2 over three steps
  (two capture steps, one normal): before each step the fused run's weights are set to the
  foreach run's, so both take the step on the same gradients and captures and what is
  compared is the step itself (momentum carried across steps).  Without that the model's
  own float32 sensitivity would be measured instead: ResNet's BatchNorms over two samples
  at 1x1 move a 1e-7 change of the weights a thousandfold (``test_zoo_compile.py``).
  Tolerance: ``FUSED_RTOL`` of the tensor's scale (its largest weight or update);
* no parameter fell back to another backend (the optimizer's "is stepped by" warning), the
  resolved backend is ``fused``, and the share preconditioned and ``health["params_f_one"]``
  equal the CPU float64 run's (``test_zoo.py``'s figures);
* compiled (inductor) against eager on the GPU: the first capture's factors within
  ``test_zoo_compile.py``'s tolerance, the first update within its bound.  Compiling costs
  ~20-30 s a model, so by default one transformer and one convolutional network
  (``test_zoo_compile.CI_MODELS``); ``LIGHTNING_CAFIN_ZOO_COMPILE=all`` compiles every model.

TF32 is off (cuDNN's default on for convolutions rounds inputs to 10 bits, which would
turn a 1e-7 difference between eager and compiled inputs into 1e-3) and cuDNN runs its
deterministic algorithms.  Skips without a GPU or the extension.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lightning_cafin import AdaFisher

from .models import ZOO, built_for_comparison, share_preconditioned, zoo_row
from .test_zoo import SHARE
from .test_zoo_compile import MODELS, assert_first_capture_matches, eager_and_compiled

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: Per step, the kernel's parameter and momentum match the reference within 1e-6 of their
#: scale (tests/kernels/test_fused_step.py's FP32_RTOL, ~8 float32 ulps); three steps carry
#: the momentum's rounding into the next updates: room for one more such rounding.
FUSED_RTOL = 2e-6
STEPS, TCOV = 3, 2
FELL_BACK = "is stepped by"  # the optimizer's warning when a parameter leaves the fused step


@pytest.fixture(scope="module")
def fused_ok():
    from lightning_cafin.kernels import can_run_fused

    ok, why = can_run_fused()
    if not ok:
        pytest.skip(why)


@pytest.fixture(autouse=True)
def exact_float32():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


def _to_cuda(batch):
    return tuple(t.cuda() for t in batch) if isinstance(batch, tuple) else batch.cuda()


def _setup(name):
    base, make_batch, loss = built_for_comparison(name)
    batches = [_to_cuda(make_batch(torch.float32)) for _ in range(STEPS)]
    return base.cuda(), batches, loss


def _scale(*tensors):
    return max(t.abs().max().item() for t in tensors)


@pytest.mark.parametrize("name", list(ZOO))
def test_fused_step_equals_foreach_on_the_gpu(name, fused_ok):
    base, batches, loss = _setup(name)
    snaps: list[list[torch.Tensor]] = []  # the foreach run's weights before each step, and after the last
    runs = {}
    for backend in ("foreach", "fused"):
        model = copy.deepcopy(base)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = AdaFisher(model, backend=backend, TCov=TCOV, weight_decay=1e-2)
            for i, batch in enumerate(batches):
                with torch.no_grad():
                    if backend == "foreach":
                        snaps.append([p.detach().clone() for p in model.parameters()])
                    else:
                        for p, w in zip(model.parameters(), snaps[i]):
                            p.copy_(w)
                opt.zero_grad()
                loss(model, batch).backward()
                opt.step()
                if backend == "fused":
                    _assert_step_close(model, snaps[i], _after(snaps, runs, i), f"step {i}")
            if backend == "foreach":
                runs["foreach_final"] = [p.detach().clone() for p in model.parameters()]
        runs[backend] = {"opt": opt, "model": model, "warnings": [str(w.message) for w in caught]}
    fused, foreach = runs["fused"], runs["foreach"]
    assert fused["opt"].backend == "fused"
    assert not [w for w in fused["warnings"] if FELL_BACK in w], fused["warnings"]
    moved = sum(not torch.equal(a, b) for a, b in zip(runs["foreach_final"], snaps[0]))
    assert moved > 0
    cpu = zoo_row(name)  # the CPU float64 run of test_zoo.py
    share = share_preconditioned(fused["opt"], fused["model"])
    assert share == share_preconditioned(foreach["opt"], foreach["model"]) == cpu["share"]
    assert share >= SHARE[name] - 1e-3, fused["opt"].summary()
    health = fused["opt"].health
    assert health["params_f_one"] == foreach["opt"].health["params_f_one"] == cpu["opt"].health["params_f_one"]
    assert health["modules_not_fired"] == [] and health["capture_steps"] == 2


def _assert_step_close(model, before, after, where):
    """The fused step's weights against foreach's, within FUSED_RTOL of each tensor's scale."""
    for (pname, p), b, a in zip(model.named_parameters(), before, after):
        tol = FUSED_RTOL * _scale(a, a - b)
        torch.testing.assert_close(p.detach(), a, rtol=0, atol=tol, msg=lambda m, n=pname: f"{where} {n}: {m}")


def _after(snaps, runs, i):
    """The foreach run's weights after step ``i``."""
    return snaps[i + 1] if i + 1 < len(snaps) else runs["foreach_final"]


def _rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _first_capture(model, run, batches, loss):
    """(factors after the first capture step, its gradients, weights after it, weights at the end)."""
    opt = AdaFisher(model, backend="auto", TCov=TCOV)
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)
        opt.zero_grad()
        loss(run, batch).backward()
        if i == 0:
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        if i == 0:
            factors = {n: (f.S.clone(), f.H.clone()) for n, f in opt.factors().items()}
            first = [p.detach().clone() for p in model.parameters()]
    return factors, grads, first, [p.detach().clone() for p in model.parameters()], opt.backend


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_compiled_zoo_model_matches_eager_on_the_gpu(name, fused_ok):
    base, batches, loss = _setup(name)
    eager, compiled = eager_and_compiled(base, _first_capture, batches, loss)
    assert compiled[4] == eager[4] == "fused"
    assert set(compiled[0]) == set(eager[0]) and compiled[0]
    assert_first_capture_matches(name, compiled[0], eager[0], compiled[1], eager[1], compiled[2], eager[2])
    assert all(torch.isfinite(p).all() for p in compiled[3])
