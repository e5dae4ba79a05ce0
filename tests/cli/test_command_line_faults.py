"""Command-line faults of issue 39 (round 4): an interpolation in the run directory that does
not resolve (item 19), the printed "to continue" command for unusual directory names (item 24),
a job refused after Hydra made its directory (item 6), and a refused resume that wrote into the
log of the run owning the directory (item 25)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from support.runs import run_cli

from mptrain.rundir.command import continue_command, hydra_quoted

TINY = ["model=mlp", "epochs=null", "max_steps=3", "progress=false", "threads=1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hydra.run.dir=${nope}"], "hydra.run.dir: Interpolation key 'nope' not found"),
        (
            ["-m", "hydra.sweep.dir=${oc.env:MPTRAIN_SURELY_UNSET}"],
            'hydra.sweep.dir: KeyError raised while resolving interpolation: "Environment '
            "variable 'MPTRAIN_SURELY_UNSET' not found\"",
        ),
    ],
)
def test_an_unresolvable_run_directory_is_one_line(args, message, tmp_path, monkeypatch):
    outcome = run_cli([*TINY, *args], tmp_path, monkeypatch)
    assert outcome.code == 2, outcome
    assert outcome.stderr == f"mptrain: error: {message}\n"


@pytest.mark.parametrize(
    "name", ["plain-run_1", "ü dir", "a(b)", "x,y", "k=v", "it's", 'say "hi"', "back\\slash"]
)
def test_the_continue_command_reads_back_as_the_directory(name, tmp_path):
    """The command is split by the shell, then the override by Hydra's grammar: both must give
    back the directory (Hydra reads ( , = and spaces as structure)."""
    run_dir = tmp_path / name
    command = continue_command(["model=mlp", "max_steps=3"], run_dir)
    words = shlex.split(command)
    assert words[0] == "mptrain" and {"model=mlp", "max_steps=3", "resume=auto"} <= set(words)
    override = OverridesParser.create().parse_override(words[-1])
    assert override.key_or_group == "hydra.run.dir" and override.value() == str(run_dir)
    assert hydra_quoted("/plain/path-1_2.x") == "/plain/path-1_2.x"  # unquoted where it can be


def test_a_job_refused_after_hydra_made_its_directory_says_why_in_its_log(tmp_path, monkeypatch):
    outcome = run_cli(
        ["precision=fp8", "model=cnn", "hydra.run.dir=run"], tmp_path, monkeypatch, jobs=True
    )
    assert outcome.code == 2, outcome
    said = outcome.stderr.removeprefix("mptrain: error: ").strip()
    log = (tmp_path / "run" / "mptrain.log").read_text()
    assert log.strip().endswith(f"[ERROR] - error: {said}")


def test_a_refused_resume_leaves_the_owners_log_as_it_was(tmp_path, monkeypatch):
    first = run_cli([*TINY, "hydra.run.dir=run"], tmp_path, monkeypatch, jobs=True)
    assert first.code == 0, first
    log = Path(tmp_path / "run" / "mptrain.log")
    before = log.read_text()
    refused = run_cli(
        [*TINY[:-3], "max_steps=5", "progress=false", "hydra.run.dir=run", "resume=auto"],
        tmp_path, monkeypatch, jobs=True,
    )  # fmt: skip
    assert refused.code == 2 and "saved with different settings" in refused.stderr, refused
    assert log.read_text() == before
