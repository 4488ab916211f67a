"""The dashboard in a real browser: a short run's logs served by TensorBoard, the Custom
Scalars page loaded in headless Chromium, both sections drawn with data in every chart."""

import re

import pytest

from lightning_cafin import CAFINCallback
from lightning_cafin.monitor.tags import CAFIN, CHARTS, PRECONDITIONER

from . import dashboard_browser as browser
from .test_callback import Module, loader, trainer

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))


def test_custom_scalars_page_renders_both_sections_with_data(tmp_path):
    trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=8)).fit(Module(), loader())
    shot = tmp_path / "custom_scalars.png"
    with browser.tensorboard(str(tmp_path / "tb")) as url:
        page = browser.load_custom_scalars(url, str(shot))
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
    per_section = {s: sum(1 for c in CHARTS if c.section == s) for s in (CAFIN, PRECONDITIONER)}
    assert page.sections == per_section
    for chart in CHARTS:
        regex = "^" + re.escape(chart.tag) + "$"
        runs = page.data.get(regex)
        assert runs, f"no data drawn for {chart.tag}"
        named = {run.rsplit("/cafin/", 1)[1] if "/cafin/" in run else "" for run in runs}
        expected = {s for s in chart.series if not s.startswith("<")} - {"device"}  # no CUDA events on a CPU
        assert expected <= named, (chart.tag, named)
        if not chart.series:
            assert named == {""}, (chart.tag, named)
    # the layer-type series of the Preconditioner section: one run per supported layer type of the model
    assert {"Conv2d", "BatchNorm2d", "Linear", "LayerNorm"} <= {
        r.rsplit("/cafin/", 1)[1] for r in page.data["^" + re.escape("cafin/precond/F_max_per_Lambda") + "$"]
    }
