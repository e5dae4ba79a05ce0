"""What a new user types first (issue 28, 'First contact'): arguments that are neither a flag nor an
override, ``--help``, ``COMMAND --help``, ``--version`` and a command word mptrain does not have.
In-process through :func:`mptrain.cli.app.main` (tests/conftest.py's ``run_cli``), except the console
script's help, timed as a user runs it."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest
from support.processes import describe, run_command
from support.runs import run_cli

from mptrain import __version__
from mptrain.cli import app as cli
from mptrain.cli.preflight import parse_command_line


def only_error(outcome) -> str:
    """The one error line of a refused command (exit code 2, nothing launched)."""
    assert outcome.code == 2, outcome
    assert not outcome.launched, outcome
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1, outcome
    return lines[0].removeprefix("mptrain: error: ")


def printed(args: list[str], monkeypatch) -> str:
    """stdout of ``mptrain <args>``, which must exit 0 without composing a config."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)

    def no_composing() -> None:
        raise AssertionError("composed a config to answer this")

    monkeypatch.setattr(cli, "register_configs", no_composing)
    cli.main(args)
    return out.getvalue()


# ------------------------------------------------------------------------ nothing dropped silently
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["model=mlp", "--epochs=1", "progress=false"],
            "--epochs=1: not an option; did you mean epochs=1?",
        ),
        (["--max_iters=100"], "--max_iters=100: not an option; did you mean max_steps=100?"),
        (["--epochs", "3", "model=mlp"], "--epochs: not an option; did you mean epochs=3?"),
        (["-m", "model=mlp", "--bf16"], "--bf16: not an option; did you mean precision=bf16?"),
        (["--verison"], "--verison: not an option; did you mean --version?"),
        (["--frobnicate"], "--frobnicate: not an option; mptrain --help lists the options"),
        (["model=mlp", "fast"], "fast: not an override; give key=value (or ~key to delete a key)"),
    ],
)
def test_an_argument_that_is_no_flag_nor_override_stops_in_one_line(
    tmp_path, monkeypatch, args, error
):
    assert only_error(run_cli(args, tmp_path, monkeypatch)) == error
    assert not (tmp_path / "outputs").exists()


def test_overrides_after_a_flag_are_kept():
    args = parse_command_line(["model=mlp", "--cfg", "job", "seed=1", "-m", "precision=fp32,bf16"])
    assert args.overrides == ["model=mlp", "seed=1", "precision=fp32,bf16"]
    assert (args.cfg, args.multirun) == ("job", True)


def test_cfg_job_takes_overrides_before_and_after_its_flags(tmp_path):
    """Hydra's own parse refuses an override after ``--cfg job``; mptrain hands it the flags first."""
    result = run_command(
        tmp_path,
        sys.executable,
        *("-m", "mptrain", "model=mlp", "--cfg", "job", "-p", "model", "model.dropout=0.5"),
    )
    assert result.returncode == 0, describe(result)
    assert "name: mlp" in result.stdout and "dropout: 0.5" in result.stdout


# -------------------------------------------------------------------------------- commands
def test_an_unknown_command_names_the_commands(tmp_path, monkeypatch):
    assert only_error(run_cli(["evaluate", "model=mlp"], tmp_path, monkeypatch)) == (
        "unknown command 'evaluate'; did you mean eval? commands are advise, bench, eval, sample "
        "(training takes overrides: mptrain key=value ...)"
    )


@pytest.mark.parametrize("word", ["fit", "train"])
def test_a_training_word_points_to_training_without_one(tmp_path, monkeypatch, word):
    """Issue 39, item 5: Lightning's fit, other tools' train were refused pointing nowhere."""
    assert only_error(run_cli([word, "model=mlp"], tmp_path, monkeypatch)) == (
        f"unknown command '{word}'; mptrain trains without one: mptrain key=value ... "
        "(e.g. mptrain model=mlp epochs=5); commands are advise, bench, eval, sample"
    )


def test_compare_points_to_mptrain_compare_and_the_help_lists_it(tmp_path, monkeypatch):
    assert only_error(run_cli(["compare", "outputs"], tmp_path, monkeypatch)).startswith(
        "unknown command 'compare'; runs are compared by mptrain-compare RUN_OR_SWEEP_DIR"
    )
    from mptrain.cli.usage import usage_text

    assert "  (compare) mptrain-compare RUN_OR_SWEEP_DIR ..." in usage_text()


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_a_run_given_as_a_word_is_read_as_resume(tmp_path, monkeypatch, command):
    """``mptrain eval RUN`` said "cannot parse override", ``mptrain sample RUN`` "unknown
    command 'RUN'": both read RUN as resume=RUN (here a path that is not there, named)."""
    outcome = run_cli([command, "no_such_run"], tmp_path, monkeypatch)
    assert outcome.code == 2
    assert outcome.stderr.startswith("mptrain: error: resume='no_such_run': no such file"), outcome


def test_the_commands_of_the_help_are_the_cli_s():
    from mptrain.cli.arguments import COMMANDS
    from mptrain.cli.usage import COMMAND_DOCS

    assert set(COMMANDS) == set(cli._SUBCOMMANDS) == set(COMMAND_DOCS)


# ------------------------------------------------------------------------------------- help
def test_help_is_a_short_usage_with_commands_groups_and_where_the_rest_is(monkeypatch):
    text = printed(["--help"], monkeypatch)
    assert len(text.splitlines()) < 40
    for command in ("advise", "bench", "eval", "sample"):
        assert f"\n  {command} " in text
    assert (
        "  precision  auto*, fp32, fp16, bf16, fp8, mxfp8, nvfp4, fp16_noscale, fp16_pure, bf16_pure"
        in text
    )
    assert "16-mixed" in text and "model      mlp, cnn*," in text and "recipe     " in text
    assert "mptrain --cfg job" in text and "--hydra-help" in text


def test_help_lists_the_options_of_the_user_s_config_directory(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mlp_wide.yaml").write_text("defaults:\n  - mlp\n", encoding="utf-8")
    text = printed(["-cd", str(tmp_path), "--help"], monkeypatch)
    assert "custom, hf, mlp_wide" in text  # the packaged options, then the directory's


@pytest.mark.parametrize("command", ["advise", "bench", "eval", "sample"])
def test_each_command_has_its_own_help(monkeypatch, command):
    text = printed([command, "--help"], monkeypatch)
    assert text.startswith(f"usage: mptrain {command} ")
    assert f"  {command}." in text  # its keys, from conf/config.yaml
    assert "docs: docs/" in text


def test_version_is_mptrain_s(monkeypatch):
    assert printed(["--version"], monkeypatch).startswith(f"mptrain {__version__} ")


@pytest.mark.slow
def test_console_script_help_is_fast(tmp_path):
    """Hydra's help composed the whole config (2.5 s here, 6.5-15 s with torch imported)."""
    script = Path(sys.executable).parent / "mptrain"
    started = time.perf_counter()
    result = run_command(tmp_path, str(script), "--help")
    took = time.perf_counter() - started
    assert result.returncode == 0, describe(result)
    assert result.stdout.startswith("usage: mptrain")
    assert took < 2.0, f"mptrain --help took {took:.2f} s"
