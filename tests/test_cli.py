"""The ``cafin`` CLI: every config runs as written, the quick start learns, bad input fails clearly."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_cafin import AdaFisher, AdaFisherW, CAFINCallback
from lightning_cafin.capture.layers import rule_for
from lightning_cafin.cli import CafinCLI, main
from lightning_cafin.data import DEBIAN_FASHION_MNIST

from .data.cifar_files import write_cifar

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
needs_fashion = pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)",
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Runs in a fresh folder (logs land there), with no data folder from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    return tmp_path


def _assert_bound_and_captured(opt, model):
    """The callback bound ``opt`` to ``model`` and the first step captured every supported layer.

    (The callback unbinds at teardown; the factors it leaves behind show what was bound.)
    """
    layers = {n for n, m in model.named_modules() if rule_for(m) is not None}
    assert not opt.is_bound, "released at teardown"
    assert set(opt.factors()) == layers


def _cafin_callbacks(trainer):
    return [c for c in trainer.callbacks if isinstance(c, CAFINCallback)]


def test_there_is_a_config_for_each_recipe():
    names = {c.stem for c in CONFIGS}
    assert {"quickstart", "cifar10_resnet18", "fashion_mnist_resnet18", "fashion_mnist_transformer"} <= names


@needs_fashion
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_runs_as_written_with_fast_dev_run(workdir, config):
    spec = yaml.safe_load(config.read_text())
    args = ["fit", "--config", str(config), "--trainer.fast_dev_run=true"]
    if spec["data"]["class_path"].endswith("CIFARDataModule"):
        write_cifar(workdir / "data", spec["data"]["init_args"]["dataset"], "folder", per_file=60)
    cli = CafinCLI(args=args)
    trainer = cli.trainer
    assert trainer.global_step == 1
    opt = trainer.optimizers[0]
    expected = {"lightning_cafin.AdaFisher": AdaFisher, "lightning_cafin.AdaFisherW": AdaFisherW}
    assert type(opt) is expected[spec["optimizer"]["class_path"]]
    for key, value in spec["optimizer"]["init_args"].items():
        assert opt.defaults[key] == pytest.approx(value), key
    _assert_bound_and_captured(opt, cli.model)
    assert len(_cafin_callbacks(trainer)) == 1
    if "lr_scheduler" in spec:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        assert type(scheduler).__name__ == spec["lr_scheduler"]["class_path"].rsplit(".", 1)[1]


def _scalars(log_dir: Path, tag: str) -> list[float]:
    events = sorted(log_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[-1]))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


@needs_fashion
@pytest.mark.slow
def test_quickstart_learns_on_real_fashion_mnist(workdir, capsys):
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.max_steps=240",
               "--trainer.val_check_interval=80", "--trainer.log_every_n_steps=1",
               "--data.init_args.val_subset=1000"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TensorBoard logs:" in out and "tensorboard --logdir lightning_logs" in out
    log_dir = workdir / "lightning_logs" / "quickstart" / "version_0"
    loss = _scalars(log_dir, "train/loss")  # every step; single batches are noisy, so compare means
    accuracy = _scalars(log_dir, "val/accuracy")
    assert len(loss) == 240 and len(accuracy) == 3
    # (the second capture, at step 100, shrinks F about tenfold -- the spec's averaging -- and the
    # loss jumps for a few dozen steps; the means over 20 steps still fall by more than half)
    assert sum(loss[-20:]) < 0.5 * sum(loss[:20]), loss
    assert accuracy[-1] > 0.75, accuracy  # 0.10 is chance
    # the dashboard's series are runs of their own under the training run (monitor/tags.py)
    assert "cafin/step_ms" in EventAccumulator(str(log_dir / "cafin" / "live")).Reload().Tags()["scalars"]
    assert "cafin/capture_ms" in EventAccumulator(str(log_dir / "cafin" / "host")).Reload().Tags()["scalars"]
    assert (log_dir / "config.yaml").is_file(), "LightningCLI saves the resolved config beside the logs"


@needs_fashion
def test_defaults_adafisher_tensorboard_and_the_callback(workdir):
    """With no optimizer, logger or callback in the config, the CLI still runs AdaFisher bound by the callback."""
    config = workdir / "bare.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 2, "limit_val_batches": 1, "enable_checkpointing": False},
        "model": {"class_path": "lightning_cafin.tasks.ImageClassifier",
                  "init_args": {"net": {"class_path": "lightning_cafin.models.SmallCNN"}}},
        "data": {"class_path": "lightning_cafin.data.IDXDataModule", "init_args": {"train_subset": 512}},
    }))
    cli = CafinCLI(args=["fit", "--config", str(config)])
    assert type(cli.trainer.optimizers[0]) is AdaFisher
    _assert_bound_and_captured(cli.trainer.optimizers[0], cli.model)
    assert len(_cafin_callbacks(cli.trainer)) == 1
    assert type(cli.trainer.logger).__name__ == "TensorBoardLogger"
    log_dir = Path(cli.trainer.logger.log_dir).resolve()
    assert log_dir.is_relative_to(workdir.resolve() / "lightning_logs" / "cafin")


@needs_fashion
def test_no_callback_is_added_for_other_optimizers(workdir):
    cli = CafinCLI(args=["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.fast_dev_run=true",
                         "--trainer.callbacks=[]", "--optimizer=torch.optim.SGD", "--optimizer.lr=0.1"])
    assert type(cli.trainer.optimizers[0]).__name__ == "SGD"
    assert _cafin_callbacks(cli.trainer) == []


def test_missing_data_ends_with_where_it_looked(workdir, capsys):
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.fast_dev_run=true",
               "--data.init_args.dataset=mnist", f"--data.init_args.root={workdir / 'empty'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cafin: mnist train files not found" in err and str(workdir / "empty") in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optimizer.init_args.Lamda=0.1", "Option 'Lamda' is not accepted"),
        ("--optimizer.init_args.lr=fast", "Expected a <class 'float'>"),  # lr: float or a tensor
        ("--trainer.max_stepz=3", "max_stepz"),
    ],
)
def test_bad_config_fails_with_lightningclis_error(workdir, capsys, override, message):
    with pytest.raises(SystemExit) as exit_info:
        CafinCLI(args=["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), override])
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err


def test_unknown_key_in_a_yaml_file_is_refused(workdir, capsys):
    spec = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    spec["optimizer"]["init_args"]["betas"] = [0.9, 0.99]  # an Adam argument AdaFisher does not take
    bad = workdir / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(SystemExit):
        CafinCLI(args=["fit", "--config", str(bad)])
    assert "betas" in capsys.readouterr().err


def test_console_script_is_installed_and_shows_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "lightning_cafin.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for sub in ("fit", "validate", "test"):
        assert sub in out.stdout


@needs_fashion
@pytest.mark.parametrize("subcommand, metric", [("validate", "val/accuracy"), ("test", "test/accuracy")])
def test_validate_and_test_subcommands(workdir, subcommand, metric):
    cli = CafinCLI(args=[subcommand, "--config", str(REPO / "configs" / "quickstart.yaml"),
                         f"--trainer.limit_{'val' if subcommand == 'validate' else 'test'}_batches=2"])
    assert 0.0 <= float(cli.trainer.callback_metrics[metric]) <= 1.0


@needs_fashion
def test_a_single_callback_given_as_a_mapping_is_kept(workdir):
    cli = CafinCLI(args=["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.fast_dev_run=true",
                         "--trainer.callbacks={'class_path': 'lightning_cafin.CAFINCallback', "
                         "'init_args': {'divergence_every_n_steps': 7}}"])
    (callback,) = _cafin_callbacks(cli.trainer)
    assert callback.divergence_every_n_steps == 7


# --------------------------------------------------------------------- the CLI explains itself


@pytest.mark.parametrize("argv", [[], ["fit"], ["validate", "--trainer.max_steps=3"]], ids=["bare", "fit", "validate"])
def test_no_config_points_at_the_configs_and_the_quick_start(workdir, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cafin fit --config configs/quickstart.yaml" in err
    assert str(REPO / "configs") in err and "quickstart.yaml" in err
    assert "Quick start" in err
    assert not (workdir / "lightning_logs").exists()


def test_no_config_from_the_console_exits_2_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lightning_cafin.cli", "fit"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert "configs/quickstart.yaml" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "override, named",
    [
        ("--optimizer.init_args.lr=-1", "--optimizer.init_args.lr=-1.0 is refused by AdaFisher: lr must be >= 0"),
        ("--optimizer.init_args.beta=1.5", "--optimizer.init_args.beta=1.5 is refused by AdaFisher"),
        ("--optimizer.init_args.Lambda=0", "--optimizer.init_args.Lambda=0.0 is refused by AdaFisher"),
    ],
)
def test_refused_hyperparameter_is_a_usage_error_naming_it(workdir, capsys, override, named):
    # (one step at most, should the refusal ever fail)
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), override, "--trainer.max_steps=1",
               "--trainer.limit_val_batches=0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert named in err, err
    assert "Traceback" not in err
    assert not (workdir / "lightning_logs").exists(), "refused before any logger exists"


def test_refused_hyperparameter_from_the_console_has_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lightning_cafin.cli", "fit", "--config",
                          str(REPO / "configs" / "quickstart.yaml"), "--optimizer.init_args.lr=-1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "usage: cafin" in out.stderr and "--optimizer.init_args.lr=-1.0" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_data_names_the_root_and_download_options(workdir, capsys):
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
               "--data.init_args.dataset=mnist", f"--data.init_args.root={workdir / 'empty'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--data.init_args.root=" in err and "--data.init_args.download=true" in err
    assert "download: true" in err


def test_a_run_that_fails_before_training_leaves_no_log_version(workdir, capsys):
    (workdir / "lightning_logs" / "quickstart" / "version_0").mkdir(parents=True)  # an earlier run's
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
               "--data.init_args.dataset=mnist", f"--data.init_args.root={workdir / 'empty'}"])
    assert rc == 2
    assert sorted(p.name for p in (workdir / "lightning_logs" / "quickstart").iterdir()) == ["version_0"]


def test_a_run_that_fails_before_training_removes_the_folders_it_made(workdir, capsys):
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
               "--data.init_args.dataset=mnist", f"--data.init_args.root={workdir / 'empty'}"])
    assert rc == 2
    assert not (workdir / "lightning_logs").exists()


@needs_fashion
def test_a_fit_shorter_than_the_logging_interval_warns_and_the_warning_is_true(workdir):
    with pytest.warns(UserWarning, match=r"max_steps=3 is below the logging interval \(log_every_n_steps=25\): "
                                         r"no cafin/ scalars will be written"):
        rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.max_steps=3",
                   "--trainer.limit_val_batches=1", "--data.init_args.train_subset=512"])
    assert rc == 0
    log_dir = workdir / "lightning_logs" / "quickstart" / "version_0"
    acc = EventAccumulator(str(next(log_dir.glob("events.*"))))
    acc.Reload()
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("cafin/")]


@needs_fashion
def test_a_fit_as_long_as_the_logging_interval_does_not_warn(workdir, recwarn):
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.max_steps=2",
               "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=1", "--data.init_args.train_subset=512"])
    assert rc == 0
    assert not [w for w in recwarn if "below the logging interval" in str(w.message)]
