"""Bad input gets an error that names the argument and the fix."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW


def params():
    return nn.Linear(3, 2).parameters()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"lr": "fast"}, TypeError, "lr must be a real number"),
        ({"beta": 1.0}, ValueError, r"beta must be in \[0, 1\)"),
        ({"gamma": 0.0}, ValueError, "gamma must be in"),
        ({"Lambda": 0.0}, ValueError, "Lambda must be > 0"),
        ({"Lambda": float("nan")}, ValueError, "Lambda must be finite"),
        ({"TCov": 0}, ValueError, "TCov must be an integer >= 1"),
        ({"TCov": 2.5}, ValueError, "TCov must be an integer"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"backend": "cuda"}, ValueError, "backend='cuda' is not one of"),
        ({"gammas": [0.92, 0.008]}, TypeError, r"gammas: AdaFisher takes one `gamma`"),
        ({"betas": (0.9, 0.999)}, TypeError, "pass beta="),
        ({"lamda": 1e-3}, TypeError, "did you mean `Lambda`"),
    ],
)
@pytest.mark.parametrize("cls", [AdaFisher, AdaFisherW])
def test_bad_arguments(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(params(), **kwargs)


def test_bad_param_group_values_are_checked_too():
    with pytest.raises(ValueError, match="lr must be >= 0"):
        AdaFisher([{"params": params(), "lr": -1}])
    with pytest.raises(ValueError, match="TCov=5 in a param group differs"):
        AdaFisher([{"params": params(), "TCov": 5}])


def test_complex_parameters_are_refused():
    with pytest.raises(TypeError, match="complex parameters.*view_as_real"):
        AdaFisher([nn.Parameter(torch.randn(3, dtype=torch.complex64))])


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = AdaFisher(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(.*sparse=False"):
        opt.step()


def test_model_without_supported_layers_warns():
    with pytest.warns(UserWarning, match="no supported layer"):
        AdaFisher(nn.Sequential(nn.Embedding(5, 2), nn.GRU(2, 2)))


def test_unbound_optimizer_warns_once_at_its_first_step():
    lin = nn.Linear(3, 2)
    opt = AdaFisher(lin.parameters())
    lin(torch.randn(4, 3)).sum().backward()
    with pytest.warns(UserWarning, match="not bound to a model"):
        opt.step()
    assert "2 tensors" in opt.summary() and "use F = 1" in opt.summary()


def test_bind_needs_a_module():
    with pytest.raises(TypeError, match="bind\\(model\\) needs a torch.nn.Module"):
        AdaFisher(params()).bind([1, 2])


def test_fused_backend_says_why_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("this machine can run the fused backend")
    with pytest.raises(RuntimeError, match="backend='fused' cannot run here: .+"):
        AdaFisher(params(), backend="fused")
