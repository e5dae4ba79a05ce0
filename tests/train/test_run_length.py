"""max_steps is the run's length when epochs is not given (issue 39, item 1), as in Hugging
Face's Trainer and Lightning; epochs alone, or both (the first reached ends the run), as before.
Before, ``mptrain model=mlp max_steps=2000`` ran 330 steps (the default 15 epochs came first) and
said nothing; the announce line and the report now say which limit ends the run."""

from __future__ import annotations

import re

import pytest
from support.runs import compose_run, tiny_run, train

from mptrain.train.build import ending_limit, prepare_run

DIGITS_STEPS_PER_EPOCH = 22  # 1437 training samples in batches of 64, the last dropped


@pytest.mark.parametrize(
    ("overrides", "total", "length"),
    [
        ((), 15 * DIGITS_STEPS_PER_EPOCH, "15 epochs"),
        (("max_steps=400",), 400, "max_steps=400"),
        (("epochs=2",), 2 * DIGITS_STEPS_PER_EPOCH, "2 epochs"),
        (("epochs=1", "max_steps=40"), DIGITS_STEPS_PER_EPOCH, "1 epoch, before max_steps=40"),
        (("epochs=2", "max_steps=30"), 30, "max_steps=30, before 2 epochs"),
        (("epochs=null", "max_steps=7"), 7, "max_steps=7"),
    ],
)
def test_the_runs_length_and_what_sets_it(overrides, total, length):
    settings = prepare_run(tiny_run(*overrides)).settings
    assert (settings.steps_per_epoch, settings.total_steps) == (DIGITS_STEPS_PER_EPOCH, total)
    assert settings.length == length


def test_the_default_length_is_recorded_as_the_number_that_ran():
    """Resolved when the config is built: report, resume signature and readers see 15."""
    cfg = tiny_run()
    assert (cfg.epochs, cfg.max_steps) == (15, None)
    assert tiny_run("max_steps=3").epochs is None


def test_the_announce_line_and_report_say_which_limit_ends_the_run(tmp_path, capsys):
    report = train(tiny_run("max_steps=30", "log_every=10"), tmp_path)
    assert report["training"]["steps"] == 30 and report["training"]["length"] == "max_steps=30"
    out = capsys.readouterr().out
    assert "| 30 steps (max_steps=30) | cpu | run dir" in out
    assert re.search(r"steps +30 of 30 \(1 epoch; length: max_steps=30\)", out)


DOCS = ("docs/checkpoints.md", "docs/precisions.md", "README.md")


def test_the_docs_max_steps_examples_run_that_many_steps():
    """The examples users copy (``max_steps=2000``, ``precision.switch.at=300 max_steps=400``)
    do what they say: without epochs on the line, max_steps is the length."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for page in DOCS:
        for line in (root / page).read_text().splitlines():
            args = line.split("#")[0].split()
            if args[:1] != ["mptrain"] or not any(a.startswith("max_steps=") for a in args):
                continue
            if any(a.startswith(("epochs=", "recipe=", "-", "hydra.")) for a in args):
                continue
            steps = int(next(a for a in args if a.startswith("max_steps=")).split("=")[1])
            cfg = compose_run(*[a for a in args[1:] if "=" in a and not a.startswith("resume")])
            found.append(line)
            assert ending_limit(cfg.epochs, cfg.max_steps, DIGITS_STEPS_PER_EPOCH) == (
                f"max_steps={steps}"
            ), line
            switch_at = cfg.precision.switch.at
            if isinstance(switch_at, int):
                assert switch_at < steps, line  # the switch happens within the run
    assert any("max_steps=2000" in line for line in found)
    assert any("precision.switch.at=300 max_steps=400" in line for line in found)
