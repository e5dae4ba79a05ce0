"""Hydra habits users bring from other Hydra apps, run for real: their own config directory and
search path, ``+experiment=NAME``, ``glob()`` sweeps, the joblib launcher, the Optuna sweeper and
``hydra.job.chdir=true``. The plugins are the real ones (the test extra installs them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.processes import describe, run_mptrain
from support.runs import run_cli

from mptrain.cli.preflight import check_command_line
from mptrain.config.base import ConfigError

TINY = (
    "model=mlp",
    "device=cpu",
    "progress=false",
    "epochs=null",
    "max_steps=2",
    "checkpoint.enabled=false",
    "throughput_warmup_steps=0",
)


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    """A user's config directory as lightning-hydra-template lays it out: an extra model option
    and an experiment group (``# @package _global_`` overlays)."""
    conf = tmp_path / "myconf"
    (conf / "model").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "model" / "mlp_wide.yaml").write_text("defaults:\n  - mlp\nhidden_sizes: [96, 96]\n")
    (conf / "experiment" / "quick.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /model: mlp_wide\n"
        "epochs: null\nmax_steps: 2\nbatch_size: 32\n"
    )
    return conf


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


# ------------------------------------------------------------------------ the user's own configs
@pytest.mark.slow
def test_config_dir_option_trains_with_it(tmp_path, user_conf):
    result = run_mptrain(tmp_path, "-cd", "myconf", *TINY, "model=mlp_wide", "hydra.run.dir=run")
    assert result.returncode == 0, describe(result)
    assert report_of(tmp_path / "run")["config"]["model"]["hidden_sizes"] == [96, 96]


@pytest.mark.slow
def test_experiment_overlay_from_the_user_config_dir(tmp_path, user_conf):
    result = run_mptrain(
        tmp_path,
        "--config-dir",
        str(user_conf),
        "+experiment=quick",
        "device=cpu",
        "progress=false",
        "checkpoint.enabled=false",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, describe(result)
    config = report_of(tmp_path / "run")["config"]
    assert config["model"]["hidden_sizes"] == [96, 96]
    assert (config["max_steps"], config["batch_size"]) == (2, 32)


def test_searchpath_override_finds_the_user_options(user_conf):
    searchpath = f"hydra.searchpath=[file://{user_conf}]"
    assert check_command_line([searchpath, "model=mlp_wide"]).jobs == [
        [searchpath, "model=mlp_wide"]
    ]
    with pytest.raises(ConfigError, match="model=mlp_wide: unknown option"):
        check_command_line(["model=mlp_wide"])  # not found without the search path


def test_a_user_option_with_a_bad_value_is_still_refused_early(tmp_path, user_conf):
    result = run_mptrain(tmp_path, "-cd", "myconf", "model=mlp_wide", "model.dropout=2")
    assert result.returncode == 2, describe(result)
    assert result.stderr.strip() == "mptrain: error: model.dropout=2.0: must be in [0, 1)"


# ----------------------------------------------------------------------------------- sweeps
def test_glob_sweep_expands_against_the_config_options():
    checked = check_command_line(["-m", "precision=glob(fp16*)", "model=mlp"])
    precisions = sorted(job[0] for job in checked.jobs)
    assert precisions == ["precision=fp16", "precision=fp16_noscale", "precision=fp16_pure"]


def test_sweeper_params_in_a_config_are_expanded_and_checked(user_conf):
    sweep = "# @package _global_\nhydra:\n  sweeper:\n    params:\n      batch_size: {}\n"
    (user_conf / "experiment" / "batches.yaml").write_text(sweep.format("16,32"))
    checked = check_command_line(["-m", "-cd", str(user_conf), "+experiment=batches"])
    assert sorted(job[0] for job in checked.jobs) == ["batch_size=16", "batch_size=32"]
    (user_conf / "experiment" / "batches.yaml").write_text(sweep.format("16,0"))
    with pytest.raises(ConfigError, match="batch_size=0"):
        check_command_line(["-m", "-cd", str(user_conf), "+experiment=batches"])


@pytest.mark.slow
def test_joblib_sweep_whose_jobs_all_fail_exits_1(tmp_path):
    # Absent CIFAR files are found when each job loads its data, in joblib's worker processes.
    result = run_mptrain(
        tmp_path,
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *TINY,
        "dataset=cifar10",
        "seed=1,2",
        "hydra.sweep.dir=sweep",
    )
    assert result.returncode == 1, describe(result)
    assert "mptrain: 2 job(s) did not complete:" in result.stderr
    assert result.stderr.count("cifar10 files not found") >= 2


def test_optuna_minimising_accuracy_is_refused(tmp_path, monkeypatch):
    search = ("-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-4,1e-2)")
    result = run_cli([*search, *TINY], tmp_path, monkeypatch)
    assert result.code == 2 and not result.launched, result
    assert "add hydra.sweeper.direction=maximize" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_optuna_over_a_language_model_must_minimise_its_loss(tmp_path, monkeypatch):
    """task=lm jobs return the final validation loss: maximising it would seek the worst model."""
    search = ("-m", "hydra/sweeper=optuna", "optimizer.lr=interval(1e-4,1e-2)", "task=lm")
    result = run_cli([*search, "hydra.sweeper.direction=maximize"], tmp_path, monkeypatch)
    assert result.code == 2 and not result.launched, result
    assert "task=lm returns its val loss (lower is better)" in result.stderr
    assert "add hydra.sweeper.direction=minimize" in result.stderr
    result = run_cli([*search, "hydra.sweeper.direction=minimize"], tmp_path, monkeypatch)
    assert result.code == 0 and result.launched, result


@pytest.mark.slow
def test_optuna_searches_the_learning_rate_maximising_accuracy(tmp_path):
    result = run_mptrain(
        tmp_path,
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=interval(1e-4,1e-2)",
        *TINY,
        "max_steps=10",
        "hydra.sweep.dir=sweep",
    )
    assert result.returncode == 0, describe(result)
    sweep = tmp_path / "sweep"
    jobs = [report_of(d) for d in sorted(sweep.iterdir()) if (d / "report.json").is_file()]
    assert len(jobs) == 3
    lrs = {job["config"]["optimizer"]["lr"] for job in jobs}
    assert len(lrs) == 3 and all(1e-4 <= lr <= 1e-2 for lr in lrs)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    accuracies = [job["evaluation"]["final_val_accuracy"] for job in jobs]
    assert best["best_value"] == pytest.approx(max(accuracies))


@pytest.mark.slow
def test_optuna_values_outside_the_ranges_fail_that_job_not_the_check(tmp_path):
    # The sweeper picks the values as it runs: the preflight checks the fixed ones; a trial with a
    # bad value fails as a job, and the exit code says so.
    result = run_mptrain(
        tmp_path,
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.n_trials=1",
        "label_smoothing=interval(1.5,2.0)",
        *TINY,
        "hydra.sweep.dir=sweep",
    )
    assert result.returncode == 1, describe(result)
    assert "label_smoothing=" in result.stderr and "must be in [0, 1)" in result.stderr


@pytest.mark.slow
def test_optuna_search_whose_trials_all_fail_ends_in_one_line_and_its_summary(
    tmp_path, monkeypatch
):
    # Optuna has no best trial to report and raises; Hydra's end-of-sweep callback never runs.
    search = (
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.n_trials=2",
        "label_smoothing=interval(1.5,2.0)",
    )
    result = run_cli([*search, *TINY, "hydra.sweep.dir=sweep"], tmp_path, monkeypatch, jobs=True)
    assert result.code == 1, result
    assert "Traceback" not in result.stderr
    assert (
        "mptrain: error: every job of the sweep failed, and then the sweeper stopped "
        "(ValueError: No trials are completed yet.)\nmptrain: 2 job(s) did not complete:\n"
    ) in result.stderr
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [row["status"] for row in rows] == ["failed", "failed"]
    assert all("must be in [0, 1)" in row["reason"] for row in rows)
    assert (tmp_path / "sweep" / "sweep.md").is_file()


def test_sweep_syntax_needs_multirun():
    with pytest.raises(ConfigError, match=r"seed=1,2: a sweep; run it with -m"):
        check_command_line(["seed=1,2"])


# ------------------------------------------------------------------------------- hydra.job.chdir
@pytest.mark.slow
def test_chdir_job_finds_relative_resume_and_data_paths(tmp_path):
    first = run_mptrain(tmp_path, *TINY, "checkpoint.enabled=true", "hydra.run.dir=first")
    assert first.returncode == 0, describe(first)
    resumed = run_mptrain(
        tmp_path,
        *TINY,
        "checkpoint.enabled=true",
        "hydra.job.chdir=true",
        "resume=first",
        "resume_allow_changes=true",
        "max_steps=4",
        "hydra.run.dir=second",
    )
    assert resumed.returncode == 0, describe(resumed)
    resume = report_of(tmp_path / "second")["resumed"]
    assert resume["from"] == str(tmp_path / "first" / "checkpoints" / "step_00000002.pt")
    missing = run_mptrain(
        tmp_path, *TINY, "hydra.job.chdir=true", "dataset=mnist", "dataset.root=mydata"
    )
    assert missing.returncode == 2, describe(missing)
    assert f"{tmp_path / 'mydata'}" in missing.stderr


@pytest.mark.slow
def test_chdir_job_imports_targets_and_writes_trackers_from_the_launch_directory(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    examples = Path(__file__).resolve().parents[2] / "examples"
    for source in examples.glob("*.py"):
        shutil.copy(source, tmp_path)
    result = run_mptrain(
        tmp_path,
        *TINY,
        "model=custom",
        "model._target_=tiny_net.TinyNet",
        "dataset=custom",
        "dataset._target_=blobs.make_blobs",
        "logger=[tensorboard,mlflow]",
        "tensorboard.log_dir=tb",
        "hydra.job.chdir=true",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, describe(result)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "mlruns").is_dir() and not (tmp_path / "run" / "mlruns").exists()


@pytest.mark.slow
def test_a_reused_sweep_directory_judges_only_this_launch(tmp_path):
    failed = run_mptrain(tmp_path, "-m", *TINY, "dataset=cifar10", "hydra.sweep.dir=sweep")
    assert failed.returncode == 1, describe(failed)
    # The failed job's directory stays; a later sweep there that completes exits 0 ...
    passed = run_mptrain(tmp_path, "-m", *TINY, "seed=7", "hydra.sweep.dir=sweep")
    assert passed.returncode == 0, describe(passed)
    # ... and one that fails still exits 1, naming only its own job.
    again = run_mptrain(tmp_path, "-m", *TINY, "seed=8", "batch_size=4096", "hydra.sweep.dir=sweep")
    assert again.returncode == 1, describe(again)
    assert "1 job(s) did not complete" in again.stderr and "seed=8" in again.stderr
