"""Issue 28, 'Answered in one line, with the fix': the nearest valid spelling of an unknown key or
option, other tools' names for mptrain's settings, PyTorch Lightning's precision names as aliases
(recorded as requested), and the package to install for a Hydra plugin that is not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.runs import compose_run, tiny_run, train

from mptrain.cli.plugins import PLUGIN_PACKAGES, missing_plugin_hint
from mptrain.cli.preflight import check_command_line
from mptrain.config.base import ConfigError
from mptrain.config.options import PRECISION_ALIASES, PRECISION_NAMES
from mptrain.config.spelling import PEER_KEYS, config_keys, suggest_setting
from mptrain.precision.policy import resolve_precision


def preflight_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        check_command_line(list(overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


# -------------------------------------------------------------------------- nearest spelling
@pytest.mark.parametrize(
    ("override", "start"),
    [
        ("lr=0.01", "lr: unknown key (did you mean optimizer.lr?); accepted keys: precision, "),
        ("max_epochs=3", "max_epochs: unknown key (did you mean epochs?); accepted keys: "),
        ("trainer.max_epochs=3", "trainer: unknown key (did you mean epochs?); accepted keys: "),
        ("+trainer.max_epochs=3", "trainer: unknown key (did you mean epochs?); accepted keys: "),
        ("max_iters=100", "max_iters: unknown key (did you mean max_steps?)"),
        ("learning_rate=1e-3", "learning_rate: unknown key (did you mean optimizer.lr?)"),
        (
            "accumulate_grad_batches=4",
            "accumulate_grad_batches: unknown key (did you mean grad_accum_steps?)",
        ),
        ("gradient_clip_val=1", "gradient_clip_val: unknown key (did you mean clip_grad_norm?)"),
        ("epoch=3", "epoch: unknown key (did you mean epochs?)"),
        (
            "model.widht=3",
            "model.widht: unknown key (did you mean model.widths?); accepted keys: name",
        ),
        (
            "precision=FP16",
            "precision=FP16: unknown option (did you mean fp16?); choose one of auto,",
        ),
        (
            "optimizer=adam",
            "optimizer=adam: unknown option (did you mean adamw?); choose one of adamw",
        ),
        ("precision=16_mixed", "precision=16_mixed: unknown option (did you mean 16-mixed?)"),
        # issue 39, item 9: Hugging Face's and Lightning's names
        ("fp16=true", "fp16: unknown key (did you mean precision=fp16?)"),
        ("bf16=true", "bf16: unknown key (did you mean precision=bf16?)"),
        ("warmup_steps=100", "warmup_steps: unknown key (did you mean scheduler.warmup_steps?)"),
        ("ckpt_path=last.ckpt", "ckpt_path: unknown key (did you mean resume?)"),
    ],
)
def test_an_unknown_key_or_option_gets_the_nearest_valid_spelling(override, start):
    assert preflight_error(override).startswith(start)


def test_a_flag_spelled_as_a_key_is_that_key():
    check_command_line(["batch_size=32"])  # the same name in Lightning, nanoGPT and mptrain
    assert suggest_setting("--batch_size", "32") == "batch_size=32"
    assert suggest_setting("--grad-clip", "1.0") == "clip_grad_norm=1.0"


def test_every_peer_name_leads_to_a_key_and_is_none_itself():
    keys = config_keys()
    for peer, ours in PEER_KEYS.items():
        assert peer not in keys, peer
        key = ours.partition("=")[0]
        assert key in keys or key.startswith("hydra."), (peer, ours)


# ---------------------------------------------------------------- Lightning's precision names
LIGHTNING = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16_pure",
    "bf16-true": "bf16_pure",
    "transformer-engine": "fp8",
}


def test_the_aliases_are_lightning_s_names_of_mptrain_s_precisions():
    assert PRECISION_ALIASES == LIGHTNING
    assert set(PRECISION_ALIASES.values()) <= set(PRECISION_NAMES)


@pytest.mark.parametrize(("alias", "name"), sorted(LIGHTNING.items()))
def test_an_alias_composes_to_its_precision_and_records_itself(alias, name):
    precision = compose_run(f"precision={alias}").precision
    assert dataclasses.replace(precision, alias=None) == compose_run(f"precision={name}").precision
    assert precision.alias == alias


def test_an_alias_is_requested_and_its_precision_resolved():
    policy = resolve_precision(compose_run("precision=bf16-mixed").precision, torch.device("cpu"))
    assert (policy.requested, policy.name) == ("bf16-mixed", "bf16")
    assert policy.reason == "PyTorch Lightning's name for bf16"


def test_a_sweep_over_aliases_checks_each_job():
    checked = check_command_line(["-m", "precision=16-mixed,bf16-mixed", "model=mlp"])
    assert checked.jobs == [
        ["precision=16-mixed", "model=mlp"],
        ["precision=bf16-mixed", "model=mlp"],
    ]


def test_an_alias_set_by_hand_must_name_the_precision_that_runs():
    message = preflight_error("precision=bf16", "precision.alias=16-mixed")
    assert message.startswith("precision.alias='16-mixed': not another name for precision bf16")


@pytest.mark.slow
def test_the_report_records_the_alias_as_requested(tmp_path):
    report = train(tiny_run("precision=32-true", "max_steps=2", "epochs=null"), tmp_path / "run")
    assert report["precision"]["requested"] == "32-true"
    assert report["precision"]["effective"] == "fp32"
    assert "(requested 32-true)" in (tmp_path / "run" / "report.md").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- Hydra plugins
def test_a_plugin_that_is_not_installed_names_its_package():
    message = preflight_error("hydra/launcher=rq")
    assert message == (
        "hydra/launcher=rq: Hydra's rq launcher is not installed; pip install hydra-rq-launcher"
    )


def test_a_plugin_with_an_extra_names_the_extra_too():
    """submitit's launcher is installed here (the test extra: multi-task jobs are tested for
    real), so the hint is checked without Hydra."""
    assert missing_plugin_hint("hydra/launcher", "submitit_slurm") == (
        "hydra/launcher=submitit_slurm: Hydra's submitit_slurm launcher is not installed; "
        'pip install hydra-submitit-launcher (or pip install "mptrain[slurm]")'
    )


@pytest.mark.parametrize(
    ("group", "option", "package"),
    [
        ("hydra/launcher", "joblib", "hydra-joblib-launcher"),
        ("hydra/sweeper", "optuna", "hydra-optuna-sweeper"),
    ],
)
def test_the_sweep_plugins_name_their_package(group, option, package):
    """Installed here (the test extra), so the hint is checked without Hydra."""
    assert PLUGIN_PACKAGES[(group, option)] == package
    assert missing_plugin_hint(group, option) == (
        f"{group}={option}: Hydra's {option} {group.split('/')[1]} is not installed; "
        f"pip install {package}"
    )


def test_a_launcher_without_a_sweep_is_refused_not_ignored():
    """Hydra uses launchers for sweeps only: without -m the job would run here, one process,
    and no SLURM job would ever be submitted."""
    assert preflight_error("hydra/launcher=submitit_local", "model=mlp") == (
        "hydra/launcher=submitit_local: Hydra's launchers start the jobs of a sweep; add -m (a "
        "sweep of one job is fine: mptrain -m hydra/launcher=submitit_local ...)"
    )
