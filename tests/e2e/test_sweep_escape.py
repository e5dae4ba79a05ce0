"""A sweep job's directory never lies outside ``hydra.sweep.dir`` (issue 39, item 22).

Hydra names a job's directory after its overrides' text (``hydra.sweep.subdir``:
``<number>_<override_dirname>``), so ``..`` in a value, an absolute ``hydra.sweep.subdir`` or a
symbolic link could put a job anywhere; the preflight refuses such a sweep (exit 2, one line naming
the override and the directory) before any job runs. The refusals are checked in-process with the
preflight; one runs as a user runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import describe, run_mptrain

from mptrain.cli.preflight import check_command_line
from mptrain.config.base import ConfigError

ADVICE = "'hydra.sweep.subdir=${hydra.job.num}'"


def refusal(tmp_path: Path, monkeypatch, *overrides: str) -> str:
    """The ConfigError message of ``mptrain -m *overrides`` launched in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        check_command_line(["-m", *overrides])
    return str(exc.value)


@pytest.mark.slow
def test_a_value_climbing_out_of_the_sweep_is_refused_before_any_job_runs(tmp_path):
    """The issue's command: with Hydra's job directory <number>_<overrides>, job 0 would write to
    <launch dir>/escaped_b,<its other overrides>, and the sweep's table would leave it out."""
    result = run_mptrain(
        tmp_path,
        "-m",
        "mlflow.run_name=../../../../escaped_b,ok",
        "hydra.sweep.dir=S/inner",
        "model=mlp",
        "max_steps=2",
    )

    assert result.returncode == 2, describe(result)
    assert result.stderr.count("\n") == 1, describe(result)
    assert result.stderr.startswith(
        "mptrain: error: mlflow.run_name=../../../../escaped_b: job 0's directory would be "
        "escaped_b,"  # then the job's overrides after mlflow.run_name: a path below the launch dir
    ), describe(result)
    assert ", outside hydra.sweep.dir=S/inner; leave the key out of the directory name" in (
        result.stderr
    )
    assert f"or set {ADVICE} (quoted for the shell)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no job ran, nothing was created"


def test_dots_inside_the_sweep_pass_and_an_absolute_value_in_a_custom_subdir_is_refused(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    inside = ["mlflow.run_name=a/../b,c/d,..x", "hydra.sweep.dir=sweep", "model=mlp"]
    assert len(check_command_line(["-m", *inside]).jobs) == 3  # a/../b is sweep/b
    assert not (tmp_path / "sweep").exists(), "the check creates nothing"

    message = refusal(
        tmp_path,
        monkeypatch,
        f"mlflow.run_name=ok,{tmp_path / 'elsewhere'}",
        "hydra.sweep.dir=sweep",
        "hydra.sweep.subdir=${mlflow.run_name}",
    )
    assert message.startswith(f"mlflow.run_name={tmp_path / 'elsewhere'}: job 1's directory ")
    assert "would be elsewhere, outside hydra.sweep.dir=sweep" in message  # below the launch dir

    message = refusal(
        tmp_path,
        monkeypatch,
        "mlflow.run_name=ok,/no_such_root_dir",
        "hydra.sweep.dir=sweep",
        "hydra.sweep.subdir=${mlflow.run_name}",
    )
    assert "would be /no_such_root_dir, outside hydra.sweep.dir=sweep" in message


def test_a_job_in_the_sweep_directory_itself_is_refused(tmp_path, monkeypatch):
    """Its report.json would make the sweep directory look like one run."""
    message = refusal(
        tmp_path,
        monkeypatch,
        "mlflow.run_name=a/..,b",
        "hydra.sweep.dir=sweep",
        "hydra.sweep.subdir=${mlflow.run_name}",
    )
    assert message.startswith("mlflow.run_name=a/..: job 0's directory would be ")
    assert "hydra.sweep.dir=sweep itself" in message


def test_a_symbolic_link_out_of_the_sweep_is_refused_naming_the_subdir(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "link").symlink_to(outside)
    message = refusal(
        tmp_path,
        monkeypatch,
        "seed=0,1",
        "hydra.sweep.dir=sweep",
        "hydra.sweep.subdir=link/${hydra.job.num}",
    )
    assert message.startswith("hydra.sweep.subdir=link/0: job 0's directory would be ")
    assert "would be outside/0, outside hydra.sweep.dir=sweep" in message
