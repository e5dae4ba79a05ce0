"""Settings of the commands beside training (``bench.*``, ``advise.*``, ``eval.*``, ``sample.*``) and their range
rules. They ride in :class:`~mptrain.config.run.RunConfig` but never change what a run
computes (:data:`mptrain.config.keys.NON_TRAINING_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mptrain.config.base import (
    Accepts,
    at_least_rule,
    auto_or_count_rule,
    in_range_rule,
    positive_rule,
    require,
    setting,
)


@dataclass
class BenchConfig:
    """``mptrain bench``: how long and how often each precision is timed."""

    warmup_steps: int = setting(
        5, "optimizer steps run before timing starts", accepts=at_least_rule(1)
    )
    steps: int = setting(
        30,
        "optimizer steps timed per precision and repetition (evaluation excluded)",
        accepts=at_least_rule(1),
    )
    reps: int = setting(
        3,
        (
            "repetitions, precisions in rotating order: each ratio is the median (min–max) of "
            "per-repetition ratios; fewer than 3 are marked noisy (cannot judge the spread)"
        ),
        accepts=at_least_rule(1),
    )


# The choices advise.plan may name: mptrain.commands.advise.choices.LOW_PRECISION's names
# (tests/commands/test_advise_plan.py keeps the two in step).
ADVISE_PLAN_CHOICES = (
    "fp8", "fp8-rowwise", "fp8-delayed", "fp8-pow2", "fp8-blockwise", "mxfp8", "nvfp4",
)  # fmt: skip


# The names advise.target takes: the rows of mptrain.perf.gpus' table, their aliases, auto and
# none (tests/perf/test_roofline.py keeps the two in step).
GPU_TARGETS = (
    "h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "b200", "b300", "gb200", "gb300",
    "a100", "a100-40gb", "a100-pcie", "l4", "l40s", "rtx4090", "h100", "h200-sxm", "a100-sxm",
    "a100-80gb", "auto", "none",
)  # fmt: skip


# Range rules of advise's settings that are more than a bound (on their fields below).
PLANS = Accepts(
    lambda v: plan_choice(v) in ("auto", "false", *ADVISE_PLAN_CHOICES),
    f"auto (or true), false, or a low-precision choice: {', '.join(ADVISE_PLAN_CHOICES)}",
)
TARGETS = Accepts(
    lambda v: v.lower() in GPU_TARGETS,
    f"not a GPU this table knows; one of {', '.join(GPU_TARGETS)}",
)


@dataclass
class AdviseConfig:
    """``mptrain advise``: how long the advice may take and what counts as faithful to FP32."""

    budget_s: float = setting(
        120.0,
        "seconds for the whole advice; parts that would not fit are skipped and listed",
        accepts=positive_rule(),
    )
    tolerance: float = setting(
        0.05,
        (
            "largest relative difference of the loss trajectory to FP32's a recommended precision"
            " may show"
        ),
        accepts=positive_rule(),
    )
    max_skipped_fraction: float = setting(
        0.1,
        "share of skipped optimizer steps (lost updates) a recommended precision may have",
        accepts=in_range_rule("[0, 1)"),
    )
    fidelity_steps: int = setting(
        40,
        "optimizer steps of each precision's short run from FP32's initial weights and batches",
        accepts=at_least_rule(2),
    )
    warmup_steps: int = setting(
        3, "speed: optimizer steps run before timing starts", accepts=at_least_rule(1)
    )
    speed_steps: int = setting(
        20,
        (
            "speed: optimizer steps timed per precision and repetition at least (more to fill "
            "half the budget left; evaluation excluded)"
        ),
        accepts=at_least_rule(1),
    )
    reps: int = setting(
        3,
        "speed: repetitions, precisions in rotating order; fewer than 3 are marked noisy",
        accepts=at_least_rule(1),
    )
    plan: str = setting(
        "auto",
        (
            "per-layer plan: rank the layers by their sensitivity to a low-precision choice, keep"
            " the fewest in high precision that bring the loss within tolerance (fp8.exclude, "
            "mx.exclude, nvfp4.exclude), verified by a short run. auto (true): the choice advise "
            f"would use | a low-precision choice: {', '.join(ADVISE_PLAN_CHOICES)} | false"
        ),
        accepts=PLANS,
    )
    seeds: str = setting(
        "auto",
        (
            "finalists' fidelity runs over N seeds, for an equivalence verdict (TOST) on the "
            "final loss: auto (as many as the budget affords, 3 to 10) | N (1: the single run "
            "only)"
        ),
        accepts=auto_or_count_rule(
            "auto (as many seeds as the budget affords) or a seed count of at least 1"
        ),
    )
    alpha: float = setting(
        0.05,
        "significance level of the equivalence test: equivalent when its p-value is below",
        accepts=Accepts(lambda v: 0 < v < 0.5, "must be in the open interval (0, 0.5)"),
    )
    target: str = setting(
        "auto",
        (
            "the GPU whose speed is predicted (roofline, labelled predicted): h100, h200, b200, "
            "a100, l4, ... | auto: the GPU advise runs on (none on a CPU) | none"
        ),
        accepts=TARGETS,
    )
    # What fits: mptrain.commands.advise.fits.
    batch_size: int | None = setting(
        None,
        (
            "what fits: recommend the cheapest precision, optimizer-state choice and activation "
            "checkpointing that fit this micro-batch on advise.target's GPU (predicted from one "
            "step's accounted bytes) | null: the largest batch of each only"
        ),
        accepts=at_least_rule(1, optional=True),
    )


@dataclass
class EvalConfig:
    checkpoint: str = setting(
        "latest",
        (
            "in a run directory: latest (its newest checkpoint that loads) | best (best.pt); "
            "mptrain sample, unless given: best where the run kept best.pt"
        ),
    )


@dataclass
class SampleConfig:
    """``mptrain sample resume=PATH``: what to generate from a trained language model (which
    checkpoint: ``eval.checkpoint``; the generator's seed and device: ``seed``, ``device``)."""

    prompt: str = setting(
        "\n",
        (
            "the text to continue; prompt=TEXT (short form) is taken verbatim, spaces and "
            "punctuation kept"
        ),
    )
    max_new_tokens: int = setting(
        200, "tokens generated after the prompt", accepts=at_least_rule(1)
    )
    temperature: float = setting(
        0.8,
        "softmax temperature; 0 = always the most likely token",
        accepts=Accepts(lambda v: v >= 0, "must be >= 0 (0: the most likely token)"),
    )
    top_k: int | None = setting(
        40,
        "sample among the k most likely tokens; null = the whole vocabulary",
        accepts=at_least_rule(1, optional=True),
    )


def check_eval_checkpoint(which: str) -> None:
    """``eval.checkpoint``: which checkpoint of a run directory ``mptrain eval`` takes."""
    require(
        which in ("latest", "best"),
        "eval.checkpoint",
        which,
        "latest (the newest checkpoint that loads) or best (best.pt)",
    )


def plan_choice(plan: object) -> str:
    """``advise.plan`` normalised: "auto" (also true), "false", or the choice's name as given
    (a command line's true/false reach the string field as "True"/"False")."""
    text = str(plan).strip()
    return {"true": "auto", "false": "false", "auto": "auto"}.get(text.lower(), text)


def seed_count(seeds: str) -> int | None:
    """``advise.seeds`` as a count; None for ``auto`` (the budget decides)."""
    text = str(seeds).strip()
    return None if text == "auto" else int(text)
