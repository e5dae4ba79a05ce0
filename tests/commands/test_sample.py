"""mptrain sample's settings: composed like every command's (sample.*, seed, device,
eval.checkpoint), its short forms, and a prompt taken verbatim. Generation itself is tested on a
trained model in tests/train/test_lm.py."""

from __future__ import annotations

import pytest

from mptrain.commands.sample import sample_settings
from mptrain.config.base import ConfigError


def test_short_forms_and_full_keys_compose_to_the_same_settings():
    short = ["resume=run", "max_new_tokens=5", "temperature=0", "top_k=null", "checkpoint=best"]
    full = [
        "resume=run",
        "sample.max_new_tokens=5",
        "sample.temperature=0",
        "sample.top_k=null",
        "eval.checkpoint=best",
    ]
    (a, _), (b, _) = sample_settings(short), sample_settings(full)
    assert a.sample == b.sample and a.eval == b.eval
    assert (a.sample.max_new_tokens, a.sample.temperature, a.sample.top_k) == (5, 0.0, None)
    assert a.eval.checkpoint == "best" and a.resume == "run"


def test_the_prompt_is_taken_verbatim():
    for prompt in ("def ", "f(a, b): [x] {y}", " lead", "a=b"):
        assert sample_settings(["resume=run", f"prompt={prompt}"])[1] == prompt
        assert sample_settings(["resume=run", f"sample.prompt={prompt}"])[1] == prompt
    assert sample_settings(["resume=run"])[1] == "\n"  # the config's default


def test_seed_and_device_are_the_run_keys():
    cfg, _ = sample_settings(["resume=run", "seed=7", "device=cpu"])
    assert (cfg.seed, cfg.device) == (7, "cpu")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prompt=x"], "resume: required"),
        (["resume=run", "temperature=-1"], "sample.temperature=-1.0: must be >= 0"),
        (["resume=run", "top_k=0"], "sample.top_k=0: must be an integer >= 1"),
        (["resume=run", "checkpoint=worst"], "eval.checkpoint='worst'"),
        (["resume=run", "colour=red"], "colour: unknown key"),
        (["resume=run", "hydra.run.dir=x"], "mptrain sample writes to stdout only"),
        (["resume=run", "--multirun"], "mptrain sample takes config overrides"),
    ],
)
def test_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=None) as raised:
        sample_settings(args)
    assert message in str(raised.value) and "\n" not in str(raised.value)
