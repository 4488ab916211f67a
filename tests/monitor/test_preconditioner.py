"""The Preconditioner statistics against the full F matrix computed offline in float64."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.monitor.preconditioner import PreconditionerHealth
from lightning_cafin.monitor.tags import ALL_LAYERS
from lightning_cafin.optimizer import LayerFactors

from .offline import offline_stats

KEYS = ("F_min_per_Lambda", "F_max_per_Lambda", "lambda_dominated", "factor_change")
NAMES = {"F_min": "F_min_per_Lambda", "F_max": "F_max_per_Lambda", "lambda_dominated": "lambda_dominated",
         "factor_change": "factor_change"}


def random_factors(g, Lambda):
    # values straddling sqrt(Lambda) so that S*H < Lambda holds for part of each layer; one S entry 0
    layers = {}
    shapes = [("a", "Linear", 7, 13), ("b", "Conv2d", 5, 9), ("c", "Linear", 3, 4), ("d", "LayerNorm", 6, 2)]
    for name, kind, m, n in shapes:
        S = torch.rand(m, generator=g, dtype=torch.float64) * 4 * Lambda**0.5
        H = torch.rand(n, generator=g, dtype=torch.float64) * 4 * Lambda**0.5
        if name == "a":
            S[2] = 0.0
        layers[name] = (kind, S.float(), H.float())
    return layers


def as_factors(layers):
    return {n: LayerFactors(n, kind, S, H) for n, (kind, S, H) in layers.items()}


def renamed(stats):
    return {series: {NAMES[k]: v for k, v in values.items()} for series, values in stats.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_equal_the_full_matrix_offline(seed):
    g = torch.Generator().manual_seed(seed)
    Lambda = 1e-3
    first, second = random_factors(g, Lambda), random_factors(g, Lambda)
    health = PreconditionerHealth()
    health.on_capture(as_factors(first))
    got1 = renamed(health.read(Lambda))
    health.on_capture(as_factors(second))
    got2 = renamed(health.read(Lambda))
    want1, want2 = offline_stats(first, Lambda), offline_stats(second, Lambda, previous=first)
    assert set(got2) == set(want2) == {ALL_LAYERS, "Linear", "Conv2d", "LayerNorm"}
    assert all("factor_change" not in v for v in got1.values())  # nothing to compare the first capture with
    for got, want in ((got1, want1), (got2, want2)):
        for series in want:
            for key, value in want[series].items():
                assert got[series][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (series, key)
    assert 0 < got2[ALL_LAYERS]["lambda_dominated"] < 1


def test_two_captures_between_reads_compare_consecutive_captures():
    g = torch.Generator().manual_seed(3)
    a, b, c = (random_factors(g, 1e-3) for _ in range(3))
    health = PreconditionerHealth()
    for layers in (a, b, c):
        health.on_capture(as_factors(layers))
    got = renamed(health.read(1e-3))
    want = offline_stats(c, 1e-3, previous=b)[ALL_LAYERS]["factor_change"]
    assert got[ALL_LAYERS]["factor_change"] == pytest.approx(want)
    assert health.read(1e-3) == {}  # read once


def test_snapshot_is_a_copy_taken_at_the_capture():
    S, H = torch.full((3,), 0.1), torch.full((2,), 0.1)
    health = PreconditionerHealth()
    health.on_capture({"x": LayerFactors("x", "Linear", S, H)})
    S.fill_(1.0)  # the optimizer updates its factors in place at the next capture
    got = health.read(1e-3)
    assert got[ALL_LAYERS]["F_max"] == pytest.approx((0.01 + 1e-3) / 1e-3)


def test_with_a_real_optimizer_and_histograms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    opt = AdaFisher(model, lr=1e-2, TCov=2, backend="foreach")
    health = PreconditionerHealth(histogram_layers=["2"])

    class Watch:
        def before_update(self, o, found_inf):
            pass

        def after_update(self, o, found_inf):
            pass

        def after_capture(self, o):
            health.on_capture(o.factors())

    opt.register_step_observer(Watch())
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
    got = renamed(health.read(opt.param_groups[0]["Lambda"]))
    layers = {n: (f.layer_type, f.S, f.H) for n, f in opt.factors().items()}
    want = offline_stats(layers, opt.param_groups[0]["Lambda"])
    for series in want:
        for key in ("F_min_per_Lambda", "F_max_per_Lambda", "lambda_dominated"):
            assert got[series][key] == pytest.approx(want[series][key], rel=1e-9)
    hist = health.histograms()
    assert set(hist) == {"2"}
    torch.testing.assert_close(hist["2"][0], opt.factors()["2"].S)
