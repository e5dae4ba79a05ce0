"""The per-layer plan as pure functions on plain data, no torch: which low-precision choice it is
for, which eligible Linear layers are most sensitive to that choice's format, and the smallest set
of them to keep in high precision.

The choice (:func:`planned_choice`): among the low-precision choices measured, the one advise is
likeliest to recommend once its loss is within: one whose all-layers short run ran, on the
device's own hardware (an emulated choice is never recommended) and then the fastest step of its
runs, else the first in :data:`.choices.LOW_PRECISION`'s order (the simplest). Its layers are kept
by its own config key (:func:`exclude_key`: ``fp8.exclude``, ``mx.exclude``, ``nvfp4.exclude``).

What :mod:`.layers` measured on one batch from FP32's initial weights (every figure against the
same batch in FP32): for every eligible layer the SQNR of the model's gradient (all parameters as
one vector) with that layer **alone** in the format and with **all but** it, and the same with
**none** (the rest of the choice: its autocast) and **all** of them in the format. Gradient errors
from different layers add as powers (noise-to-signal ratios, NSR = 10^(−SQNR/10)), so a layer's
part of the all-layers error is estimated twice — what it adds alone, NSR(alone) − NSR(none), and
what keeping it removes, NSR(all) − NSR(all but) — and :func:`share` is their mean as a fraction
of NSR(all) − NSR(none). :func:`rank` orders the layers by it (ties: the lower output SQNR first).

The plan: nothing is kept when the all-layers short run is within the allowed difference to
FP32's loss; otherwise layers are kept in rank order, and short runs find the smallest such prefix
within (:func:`first_keep`, :func:`next_keep`; the prediction they start from,
:func:`predicted_gaps`, is first order: far from exact when the all-layers gap is large).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from typing import Any

from mptrain.commands.advise import choices, concise, gemms, predict
from mptrain.commands.advise.concise import db, pct
from mptrain.config.format_table import GROUP_OF_PRECISION


def exclude_key(name: str) -> str:
    """``fp8``, ``mx`` or ``nvfp4``: the group whose ``exclude`` keeps layers of choice ``name``
    (a :data:`.choices.LOW_PRECISION` name) in high precision: the format table's group of the
    precision it trains with (``fp8-blockwise`` is precision=fp8: ``fp8.exclude``)."""
    return GROUP_OF_PRECISION[choices.runs(name)]


def planned_choice(options: Sequence[dict[str, Any]]) -> str | None:
    """The choice the plan is for (module doc), from ``options`` in :data:`.choices.LOW_PRECISION`
    order, each ``{"name", "fidelity": its all-layers short run ran, "timed": on the device's
    hardware, "step_s": its latest measured step}``; None when there is none. Ties: the earlier."""

    def key(item: tuple[int, dict[str, Any]]) -> tuple[bool, bool, float, int]:
        i, o = item
        return (not o["fidelity"], not o["timed"], o["step_s"] if o["timed"] else 0.0, i)

    return min(enumerate(options), key=key)[1]["name"] if options else None


def nsr(sqnr_db: float) -> float:
    """The noise-to-signal power ratio of an SQNR in dB (inf dB: 0; −inf or NaN: inf)."""
    if math.isnan(sqnr_db):
        return math.inf
    return 10.0 ** (-sqnr_db / 10.0)


def _gain(worse: float, better: float) -> float:
    """``worse − better`` for NSRs, with inf − inf = 0 (keeping a layer that leaves the error
    non-finite removes nothing)."""
    if math.isinf(worse) and math.isinf(better):
        return 0.0
    return max(0.0, worse - better)


def error_part(layer: dict[str, Any], none_db: float, all_db: float) -> float:
    """A layer's part of the all-layers gradient NSR: the mean of what it adds alone and what
    keeping it in high precision removes (see module doc)."""
    alone = _gain(nsr(layer["alone"]["grad_sqnr_db"]), nsr(none_db))
    removed = _gain(nsr(all_db), nsr(layer["all_but"]["grad_sqnr_db"]))
    return (alone + removed) / 2


def share(layer: dict[str, Any], none_db: float, all_db: float) -> float | None:
    """:func:`error_part` as a fraction of the all-layers error above the no-FP8 floor; None when
    that error is not a finite positive number (nothing to share)."""
    total = _gain(nsr(all_db), nsr(none_db))
    if not 0 < total < math.inf:
        return None
    return error_part(layer, none_db, all_db) / total


def rank(layers: Sequence[dict[str, Any]], none_db: float, all_db: float) -> list[str]:
    """The layers' names, most sensitive first: the largest :func:`error_part`, then the lowest
    output SQNR (its own quantization error), then the model's order."""

    def key(item: tuple[int, dict[str, Any]]) -> tuple[float, float, int]:
        i, layer = item
        output_db = layer["output_sqnr_db"]
        return (
            -error_part(layer, none_db, all_db),
            -math.inf if math.isnan(output_db) else output_db,
            i,
        )

    return [layer["name"] for _, layer in sorted(enumerate(layers), key=key)]


def predicted_gaps(prefix_dbs: Sequence[float], gap_all: float | None) -> list[float | None]:
    """The loss gap to FP32 predicted for keeping the ranking's first k layers in high
    precision, k = 0..n: ``prefix_dbs[k]`` is the one-batch gradient SQNR with them kept
    (``prefix_dbs[0]``: all in FP8); the all-layers run's ``gap_all`` scaled by
    sqrt(NSR(k) / NSR(0)). None where that cannot be said (no finite gap or error to scale)."""
    base = nsr(prefix_dbs[0]) if prefix_dbs else math.inf
    if gap_all is None or not math.isfinite(gap_all) or not 0 < base < math.inf:
        return [None] * len(prefix_dbs)
    return [gap_all * math.sqrt(nsr(db) / base) for db in prefix_dbs]


def first_keep(gap_all: float | None, allowed: float, predicted: Sequence[float | None]) -> int:
    """How many of the ranked layers the first verifying run keeps in high precision: 0 when the
    all-layers run is within ``allowed`` (no run needed); else the smallest k ≥ 1, short of all
    n, predicted within; 1 when none is (or nothing could be predicted)."""
    if gap_all is not None and gap_all <= allowed:
        return 0
    n = len(predicted) - 1  # predicted[k] for k = 0..n
    return next((k for k in range(1, n) if (p := predicted[k]) is not None and p <= allowed), 1)


def next_keep(verified: dict[int, bool], n: int) -> int | None:
    """The next number of ranked layers to keep in a verifying run, given ``verified`` (k ->
    whether keeping the first k was within), or None when the search is over: down from the
    smallest k within until the one below it is not (or k = 1), up from the largest k not within
    while that stays short of all ``n`` layers. The smallest prefix within, when the loss gap
    shrinks as layers are kept: ``min`` of the k within."""
    within_ks = [k for k, ok in verified.items() if ok]
    if within_ks:
        k = min(within_ks)
        return None if k == 1 or verified.get(k - 1) is False else k - 1
    k = max(verified) + 1
    return k if k < n else None


def within(fidelity: dict[str, Any], allowed: float) -> bool:
    """A short run counts as faithful: it ran to its end and its loss never left FP32's by more
    than ``allowed`` (relative)."""
    return fidelity["diverged"] is None and fidelity["max_rel_diff"] <= allowed


# Module names Hydra's override grammar reads as one plain string in a list; others are quoted.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_WORDS = ("true", "false", "null", "inf", "nan")  # plain, but read as a bool, null or number


def add_command(plan: dict[str, Any], overrides: list[str]) -> None:
    """``plan["command"]`` once a set is verified: the command that trains with the plan's choice
    (``plan["precision"]``) and its layers kept in high precision — the user's patterns of the
    choice's exclude key and the plan's in one override, in place of the user's own."""
    kept = plan.get("kept")
    if kept is None:
        return
    name = plan["precision"]
    if not kept:
        plan["command"] = choices.command_for(overrides, name)
        return
    key = exclude_key(name)
    others = [o for o in overrides if not o.lstrip("+~").startswith(f"{key}.exclude")]
    override = exclude_override([*plan["exclude_base"], *kept], key)
    plan["command"] = f"{choices.command_for(others, name)} {shlex.quote(override)}"


def exclude_override(patterns: Sequence[str], key: str = "fp8") -> str:
    """``fp8.exclude=[head,blocks.0.mlp.fc]`` (``key``: fp8, mx or nvfp4): the override that
    keeps ``patterns`` (module-name patterns, as the exclude keys match them) in high precision;
    a name Hydra would read as a number or split is single-quoted (``'0'``)."""
    return f"{key}.exclude=[{','.join(list_item(p) for p in patterns)}]"


def list_item(name: str) -> str:
    """A module name as an item of a Hydra list override: itself, or single-quoted where Hydra
    would read it as a number, a bool or null or split it (``'0'``)."""
    if _PLAIN.fullmatch(name) and name.lower() not in _WORDS:
        return name
    return "'" + name.replace("'", "\\'") + "'"


# ------------------------------------------------------------------------------ the words
def _gap_words(run: dict[str, Any]) -> str:
    """``up to 0.52% from FP32's loss (final 0.31%)`` or ``diverged (...)``."""
    if run["diverged"]:
        return f"diverged ({run['diverged']})"
    return f"up to {pct(run['max_rel_diff'])} from FP32's loss (final {pct(run['final_rel_diff'])})"


def _names(names: Sequence[str], cap: int | None) -> str:
    """``a, b, c``; with ``cap``, the first ``cap`` names and how many more."""
    return ", ".join(names) if cap is None else concise.capped(names, cap)


def _kept_words(kept: Sequence[str], cap: int | None) -> str:
    """A verifying run's kept layers: ``a, b``, or once cut, ``8 layers (a, b, … and 3 more)``
    (the count tells runs apart whose first names are the same)."""
    names = _names(kept, cap)
    return names if names == ", ".join(kept) else f"{len(kept)} layers ({names})"


def headline(plan: dict[str, Any], cap: int | None = None) -> str:
    """The plan in one bold line: what to keep in high precision, or that no set was found
    (``cap``: name that many of the kept layers, then how many more)."""
    kept, n = plan.get("kept"), len(plan["ranking"])
    if kept is None:
        return "**No per-layer plan verified** (why: under Not measured)"
    if not kept:
        return (
            f"**Every eligible layer can stay in {plan['label']}** ({n} layer{'s' if n > 1 else ''}): "
            "nothing to keep in high precision"
        )
    return f"**Keep {len(kept)} of {n} eligible layers in high precision: {_names(kept, cap)}**"


def _ms(step_s: float | None) -> str:
    return "not measured" if step_s is None else f"{step_s * 1e3:.3g} ms/step"


def speed_line(plan: dict[str, Any]) -> str | None:
    """What keeping the plan's layers costs in speed: the step time of its verifying run beside
    the all-layers run's and BF16's (the short runs, each once: not alternated like the speed
    part); for an emulated choice that it is not a speed. None before a set is verified."""
    speed = plan.get("speed")
    if not speed:
        return None
    if speed["emulated"]:
        return f"- speed: {plan['label']} is emulated here: its step times are not a speed"
    kept, every = speed["kept_step_s"], speed["all_layers_step_s"]
    ratio = f" ({kept / every:.2f}× the all-layers step)" if kept and every else ""
    bf16 = _ms(speed["bf16_step_s"]) + (f" ({speed['bf16_note']})" if speed["bf16_note"] else "")
    return (
        f"- speed, from the short runs (each once, not alternated): with the kept layers "
        f"{_ms(kept)}{ratio}; every eligible layer in {plan['label']} {_ms(every)}; bf16 {bf16}"
    )


def evidence_lines(plan: dict[str, Any], cap: int | None = None) -> list[str]:
    """The runs behind the plan: all layers in the format, each verifying run, the predictions,
    the speed of the kept set, measured and predicted on advise.target's GPU (``cap``: as
    :func:`headline`'s)."""
    allowed = f"allowed {plan['allowed']:.1%}" if "allowed" in plan else "no allowance"
    lines = []
    if "all_layers" in plan:
        lines.append(
            f"- every eligible layer in {plan['label']}: {_gap_words(plan['all_layers'])}; {allowed}"
        )
    predicted = plan.get("predicted") or []
    for run in plan["runs"]:
        k = len(run["kept"])
        guess = (
            f", predicted {pct(predicted[k])}"
            if k < len(predicted) and predicted[k] is not None
            else ""
        )
        verdict = "within" if run["within"] else "out of tolerance"
        lines.append(
            f"- verifying run keeping {_kept_words(run['kept'], cap)}: {_gap_words(run)}{guess}: "
            f"{verdict}"
        )
    lines += [line] if (line := speed_line(plan)) else []
    return lines + ([line] if (line := predict.kept_line(plan)) else [])


TABLE_HEADERS = (
    "rank",
    "layer",
    "in × out",
    "share of the all-layers gradient error",
    "output SQNR",
    "input-grad SQNR",
    "weight-grad SQNR",
    "model-grad SQNR: alone / all but",
    "loss: alone / all but",
)


def table_rows(plan: dict[str, Any]) -> list[list[str]]:
    """One row per eligible layer, in rank order."""
    kept = plan.get("kept") or []
    return [
        [
            str(layer["rank"]),
            layer["name"] + (" (kept)" if layer["name"] in kept else ""),
            " × ".join(map(str, layer["shape"])),
            pct(layer["share"]),
            db(layer["output_sqnr_db"]),
            db(layer["input_grad_sqnr_db"]),
            db(layer["weight_grad_sqnr_db"]),
            f"{db(layer['alone']['grad_sqnr_db'])} / {db(layer['all_but']['grad_sqnr_db'])}",
            f"{pct(layer['alone']['loss_rel'])} / {pct(layer['all_but']['loss_rel'])}",
        ]
        for layer in sorted(plan["layers"], key=lambda row: row["rank"])
    ]


def summary_lines(plan: dict[str, Any], cap: int | None = None) -> list[str]:
    """The plan's headline, the runs behind it and the command (Markdown; ``cap``: name that
    many layers of each list, then how many more — the command always whole)."""
    lines = [headline(plan, cap), "", *evidence_lines(plan, cap)]
    if plan.get("command"):
        lines += concise.command_lines(plan["command"])
    carriers = gemms.carrier_lines(plan)
    if carriers:
        lines += ["", "Which GEMM carries the error (one batch):", "", *carriers]
    per_gemm = gemms.plan_lines(plan, _gap_words, lambda names: _kept_words(names, cap))
    return lines + (["", *per_gemm] if per_gemm else [])


def section(plan: dict[str, Any] | None, figure: str) -> list[str]:
    """advise.md's per-layer plan (Markdown): the headline, the command, the runs, the ranked
    table; nothing when no layer was ranked (the reason is under Not measured)."""
    if not plan or "ranking" not in plan:
        return []
    label = plan["label"]
    table = [TABLE_HEADERS, ["---"] * len(TABLE_HEADERS), *table_rows(plan)]
    lines = [f"## {label}: layers kept in high precision", "", *summary_lines(plan), ""]
    return [
        *lines,
        *(f"| {' | '.join(cells)} |" for cells in table),
        "",
        f"One batch from FP32's initial weights, every figure against FP32's: each layer's own "
        f"error with all of them in {label} (its output and gradients from the same input), and "
        f"the model's gradient and loss with the layer alone in {label} or all but it (the rest "
        f"under {plan['autocast']} autocast, as {plan['precision']}'s runs; {plan['choice']}). "
        f"Ranked by the layer's share of the all-layers gradient error "
        f"({db(plan['all']['grad_sqnr_db'])}; no layer in {label}: "
        f"{db(plan['none']['grad_sqnr_db'])}); kept in rank order, the verifying run checks "
        f"what the gradient error predicts.",
        "",
        f"![per-layer {label} sensitivity]({figure})",
        "",
    ]


CONSOLE_FIRST = 3  # the console's ranked layers before "… and N more"


def ranked_line(plan: dict[str, Any], report: str, first: int = CONSOLE_FIRST) -> str:
    """The console's stand-in for the ranked table: how many layers, the first ``first`` with
    their share of the gradient error, and where every layer's figures are (``report``)."""
    rows = sorted(plan["layers"], key=lambda row: row["rank"])
    shown = [f"{row['name']} {pct(row['share'])}" for row in rows]
    n = len(rows)
    return (
        f"Ranked by share of the all-layers gradient error ({n} layer{'s' if n != 1 else ''}): "
        f"{concise.capped(shown, first)}; every layer's figures: {report} and advise.json"
    )


def console_section(plan: dict[str, Any] | None, report: str) -> list[str]:
    """The per-layer plan on the console (Markdown, as advise.md's :func:`section`): its
    headline, runs and command with each list of layers cut to its first few, and in place of
    the table one line with the first ranked layers; nothing when no layer was ranked."""
    if not plan or "ranking" not in plan:
        return []
    return [
        f"## {plan['label']}: layers kept in high precision",
        "",
        *summary_lines(plan, cap=concise.FIRST),
        "",
        ranked_line(plan, report),
        "",
    ]


def skipped_lines(plan: dict[str, Any] | None) -> list[str]:
    """The plan's parts not measured, with why (advise.md's Not measured list)."""
    if not plan:
        return []
    what = f"{plan['precision']} per-layer plan" if "precision" in plan else "per-layer plan"
    return [
        f"- {what}{'' if part == 'all' else ' ' + part}: {why}"
        for part, why in plan["skipped"].items()
    ]


def figure_rows(plan: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The per-layer map's rows (:func:`mptrain.output.plots.plot_layer_plan`), in rank order;
    none when no layer was ranked."""
    if not plan or "ranking" not in plan:
        return []
    kept = plan.get("kept") or []
    return [
        {
            "label": f"{row['rank']}. {row['name']}" + (" (kept)" if row["name"] in kept else ""),
            "output_sqnr_db": row["output_sqnr_db"],
            "input_grad_sqnr_db": row["input_grad_sqnr_db"],
            "weight_grad_sqnr_db": row["weight_grad_sqnr_db"],
            "alone_grad_sqnr_db": row["alone"]["grad_sqnr_db"],
            "share": row["share"],
        }
        for row in sorted(plan["layers"], key=lambda row: row["rank"])
    ]
