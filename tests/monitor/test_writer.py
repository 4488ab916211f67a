"""Series become TensorBoard runs; loggers without runs get the series in the tag."""

import glob
import os

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_cafin.monitor.writer import DashboardWriter


def test_series_are_runs_for_tensorboard_and_suffixes_elsewhere(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tb")
    csv = CSVLogger(tmp_path, name="csv")
    writer = DashboardWriter([tb, csv], is_global_zero=True)
    writer.scalars({("live", "cafin/step_ms"): 1.0, ("baseline", "cafin/step_ms"): 2.0, (None, "cafin/x"): 3.0}, 5)
    writer.close()
    csv.save()
    files = glob.glob(f"{tb.log_dir}/**/events.*", recursive=True)
    runs = {os.path.relpath(os.path.dirname(f), tb.log_dir) for f in files}
    assert {"cafin/live", "cafin/baseline"} <= runs
    header = open(os.path.join(csv.log_dir, "metrics.csv")).readline().strip().split(",")
    assert {"cafin/step_ms/live", "cafin/step_ms/baseline", "cafin/x"} <= set(header)


def test_other_ranks_write_no_series(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tb")
    DashboardWriter([tb], is_global_zero=False).scalars({("live", "cafin/step_ms"): 1.0}, 0)
    assert not os.path.exists(os.path.join(tb.log_dir, "cafin"))
