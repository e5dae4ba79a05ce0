"""What ``mptrain advise`` writes and prints: advise.json (every figure), advise.md (the
recommendation first, then the evidence table), advise.png, and the terminal's version of advise.md.

On a terminal the table is a rich table; elsewhere (a pipe, a file) the same lines as advise.md,
without escape codes. Files are written atomically (:mod:`mptrain.rundir.fileio`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from mptrain.commands.advise import choices, concise, confidence, fit_report, predict
from mptrain.commands.advise import plan as layer_plan
from mptrain.commands.advise.concise import pct
from mptrain.commands.advise.decide import CHAOS_MARGIN, NOT_MEASURED, Advice
from mptrain.commands.advise.trials import REPORT, START_UP, WARM_UP, Budget
from mptrain.platform import contention, hardware
from mptrain.report.rows import fmt_bytes
from mptrain.rundir.fileio import atomic_write_text, clean_json

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from mptrain.config.run import RunConfig

ADVISE_JSON, ADVISE_MD, ADVISE_PNG = "advise.json", "advise.md", "advise.png"
ADVISE_LAYERS_PNG = "advise_layers.png"  # the per-layer plan's map (advise.plan)


# ------------------------------------------------------------------------------ the record
def _trial(t: Any) -> dict[str, Any] | None:
    return None if t is None else {k: v for k, v in dataclasses.asdict(t).items() if k != "fp8"}


def _row(c: Any, reference: Any) -> dict[str, Any]:
    """One precision's record from an :class:`mptrain.commands.advise.measure.Candidate` (``reference``: FP32's
    fidelity Trial): what ran, its pilot, fidelity against FP32, speed, skipped parts."""
    fidelity = c.fidelity_against(reference)
    return {
        "precision": c.name,
        "label": c.label,
        "overrides": choices.command_overrides(c.choice) if c.choice else [],
        "emulated": c.emulated,
        "skipped": dict(c.skipped),
        "pilot": _trial(c.pilot),
        "fidelity": dataclasses.asdict(fidelity) if fidelity is not None else None,
        "losses": c.fidelity.losses if c.fidelity else None,
        "speed": c.speed,
    }


def _one_ulp_line(check: dict[str, Any]) -> str:
    """What FP32 does to itself under a one-ulp nudge, and what that allows the others."""
    if check["spread"] is None:
        why = check["not_run"] or "no other precision to compare"
        return f"FP32 against itself with a one-ulp nudge of its initial weights: not run ({why})."
    return (
        f"FP32 against itself with a one-ulp nudge of its initial weights: its loss moves by up "
        f"to {pct(check['spread'])}; a precision may differ from FP32 by the tolerance or "
        f"{check['margin']:g}× that, whichever is larger."
    )


def assemble(
    cfg: RunConfig, device: torch.device, found: dict[str, Any], decision: Advice, command: str
) -> dict[str, Any]:
    """advise.json's content (plain types): the setting, every figure, the decision."""
    cands, numerics = found["candidates"], found["numerics"]
    fp32 = cands[0]  # measure.candidates: FP32 first, always
    rows = [_row(c, fp32.fidelity) for c in cands]
    predict.compare(found.get("prediction"), rows)
    return {
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "task": cfg.task,
        "batch_size": cfg.batch_size,
        "device": str(device),
        "settings": dataclasses.asdict(cfg.advise),
        "hardware": hardware.hardware_info(device),
        "versions": hardware.software_versions(),
        "interrupted": found["interrupted"],  # {signal, during, after_s} or None
        "machine_load": found.get("machine_load"),  # others' load while speed was measured
        "recommendation": {
            "measured": decision.measured,  # false: FP32 not measured, nothing recommended
            "precision": decision.precision,
            "reasons": list(decision.reasons),
            "runners_up": [{"precision": p, "why": w} for p, w in decision.runners_up],
            "fixes": list(decision.fixes),
            "command": command,
        },
        "precisions": rows,
        # advise.target's GPU: each precision's predicted step, labelled so (None: not asked)
        "prediction": found.get("prediction"),
        # FP32 against itself, its initial weights nudged by one ulp: the spread (the largest
        # relative loss difference), the allowance it gives, its losses, or why it was not run
        "fp32_one_ulp_check": {
            "spread": fp32.nudge_spread,
            "margin": CHAOS_MARGIN,
            "losses": fp32.nudged.losses if fp32.nudged is not None else None,
            "not_run": fp32.nudge_note,
        },
        "numerics": {  # the probe (with its layers), audit flags, FP8's and block formats' reports
            "fp16_probe": numerics["probe"],
            "audit": numerics["audit"],
            "fp8": numerics["fp8"],
            "blocks": numerics.get("blocks", {}),
            "skipped": numerics["skipped"],
        },
        "layer_plan": found["plan"],  # the per-layer plan: every per-layer figure, the runs
        "confidence": found.get("confidence"),  # advise.seeds: every seed's figures, verdicts
        "timings_s": found["timings"],
    }


# ------------------------------------------------------------------------------ the table
FIXED_COSTS = (START_UP, WARM_UP, REPORT)
HEADERS = (
    "precision",
    "speed (min–max)",
    "vs fp32 (min–max)",
    "peak memory",
    "loss vs fp32: max / final",
    "skipped steps",
    "numerics",
)


def _speed_cells(row: dict[str, Any], lm: bool) -> list[str]:
    s = row["speed"]
    if s is None:  # why: in the "Not measured" list below the table
        return [
            "not timed: emulated, not a speed" if row["emulated"] else "not measured (below)",
            "",
            "",
        ]
    key = "tokens_per_s" if lm and "tokens_per_s" in s else "samples_per_s"
    low, high = s[f"{key}_range"]
    unit = "tokens/s" if key == "tokens_per_s" else "samples/s"
    ratio = "1.00×"
    if "vs_fp32" not in s:  # FP32's own measurement was cut short by the budget
        ratio = "n/a: FP32 not timed"
    elif row["precision"] != "fp32":
        r_low, r_high = s["vs_fp32_range"]
        ratio = f"{s['vs_fp32']:.2f}× ({r_low:.2f}–{r_high:.2f})"
        if s.get("vs_fp32_noisy"):
            ratio += " noisy"
    return [
        f"{s[key]:,.0f} {unit} ({low:,.0f}–{high:,.0f})",
        ratio,
        fmt_bytes(s["peak_memory_bytes"]),
    ]


def _fidelity_cells(row: dict[str, Any]) -> list[str]:
    f = row["fidelity"]
    if f is None:
        return ["not measured", ""]
    if row["precision"] == "fp32":
        return ["reference", str(f["skipped_steps"])]
    text = f"{pct(f['max_rel_diff'])} / {pct(f['final_rel_diff'])}"
    if f["diverged"]:
        text += f" (diverged: {f['diverged']})"
    return [text, f"{f['skipped_steps']} of {f['steps']}"]


def numerics_cell(name: str, numerics: dict[str, Any]) -> str:
    """What the numerical checks said about ``name``: probe (FP16), audit flags, FP8 layers."""
    parts = []
    probe = numerics["fp16_probe"]
    if name == "fp16" and probe:  # the verdict's headline; advise.json keeps it whole
        parts.append(probe["verdict"].split(":")[0].split(" → ")[0])
    audit = numerics["audit"].get(name)
    if audit is not None:
        flagged = audit["flagged_ops"]
        # Backward ops run outside any module's forward: the audit files them under (autograd).
        where = dict.fromkeys(  # in the order the step ran them, each once
            "backward" if o["module"] == "(autograd)" else o["module"] for o in flagged
        )
        ops = f"{len(flagged)} op{'' if len(flagged) == 1 else 's'} flagged"
        parts.append(f"audit: {ops}" + (f" ({', '.join(where)})" if flagged else ""))
    # the layer choice: a block-scaled candidate's own; else the same for every FP8 candidate
    section = numerics.get("blocks", {}).get(name)
    if section is None and choices.runs(name) == "fp8" and name != "fp8-blockwise":
        section = numerics["fp8"]
    if section and "layers" in section:
        converted = sum(layer["converted"] for layer in section["layers"])
        fmt = section.get("name", "FP8")
        parts.append(
            f"{converted} of {len(section['layers'])} Linear layers in {fmt}, "
            f"{section['converted_linear_flops_share']:.0%} of Linear FLOPs"
        )
    return "; ".join(parts)


def headers(result: dict[str, Any]) -> list[str]:
    """The evidence table's columns: HEADERS, then the predicted ones when there is a target."""
    return [*HEADERS, *predict.headers(result.get("prediction"))]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    lm = result["task"] == "lm"
    rows = []
    for row in result["precisions"]:
        predicted = predict.cells(result.get("prediction"), row["precision"], lm)
        if row["skipped"].get("all"):
            rows.append([row["label"], "not measured (below)"] + [""] * 5 + predicted)
            continue
        rows.append(
            [
                row["label"],
                *_speed_cells(row, lm),
                *_fidelity_cells(row),
                numerics_cell(row["precision"], result["numerics"]),
                *predicted,
            ]
        )
    return rows


# ------------------------------------------------------------------------------ the words
def recommendation_lines(result: dict[str, Any]) -> list[str]:
    """The decision in Markdown: the precision and why, the others, fixes, the command."""
    rec = result["recommendation"]
    headline = f"Recommendation: {rec['precision']}" if rec["measured"] else "No recommendation"
    lines = [f"**{headline}**", ""]
    lead = confidence.lead_lines(result.get("confidence"), result["interrupted"])
    lines += [*lead, ""] if lead else []
    lines += [f"- {r}" for r in rec["reasons"]]
    lines += ["", "Runners-up:", *runner_up_lines(rec["runners_up"])]
    if rec["fixes"]:
        lines += ["", "Fixes worth trying:"]
        lines += [f"- `{f.split(': ', 1)[0]}`: {f.split(': ', 1)[1]}" for f in rec["fixes"]]
    if rec["measured"]:
        lines += concise.command_lines(rec["command"])
    return lines


def runner_up_lines(runners_up: list[dict[str, Any]]) -> list[str]:
    """One line per runner-up with its command; runners-up sharing a reason on one line (the
    same refusal for every low-precision choice: said once). A group not measured points to
    Not measured, which gives its reason (advise.json keeps each one's reason and command)."""
    by_name = {r["precision"]: r for r in runners_up}
    lines = []
    for names, why in concise.grouped([(r["precision"], r["why"]) for r in runners_up]):
        if len(names) == 1:
            command = by_name[names[0]].get("command")
            lines.append(f"- {names[0]}: {why}" + (f" (`{command}`)" if command else ""))
        elif why.startswith(NOT_MEASURED):
            lines.append(f"- {concise.names_words(names)}: not measured (why: under Not measured)")
        else:
            lines.append(f"- {concise.names_words(names)}: {why}")
    return lines


def interrupted_line(result: dict[str, Any]) -> str | None:
    """``Interrupted by SIGINT after 12 s, during fidelity fp16: ...``; None when not."""
    cut = result["interrupted"]
    if cut is None:
        return None
    during = f", during {cut['during']}" if cut["during"] else ""
    return (
        f"Interrupted by {cut['signal']} after {cut['after_s']:.0f} s{during}: what was measured "
        "until then; the parts not reached are listed under Not measured."
    )


def busy_line(result: dict[str, Any]) -> str | None:
    """``Speed measured on a busy machine (...)``: none of it is called faster; None when quiet."""
    busy = contention.busy_words(result.get("machine_load"))
    if busy is None:
        return None
    return (
        f"Speed measured on a busy machine ({busy}): no precision is called faster on "
        "these figures; run advise again when the machine is quiet."
    )


def took_words(result: dict[str, Any]) -> str:
    """``7.2 s of a 10 s budget`` or ``42.0 s against a 5 s budget: 37.0 s over``."""
    budget_s, elapsed_s = result["settings"]["budget_s"], result["elapsed_s"]
    if elapsed_s > budget_s:
        return (
            f"{elapsed_s:.1f} s against a {budget_s:g} s budget: {elapsed_s - budget_s:.1f} s over"
        )
    return f"{elapsed_s:.1f} s of a {budget_s:g} s budget"


def time_lines(result: dict[str, Any]) -> list[str]:
    """The time taken against the budget, and the fixed costs in it that the budget counts but
    cannot cut short (said, not hidden: they are why a small budget is overrun)."""
    timings = result["timings_s"]
    fixed = [f"{part} {timings[part]:.1f} s" for part in FIXED_COSTS if part in timings]
    return [
        f"Time: {took_words(result)}. Fixed costs in it, which no budget cuts: {', '.join(fixed)}; "
        "a step, once started, runs to its end. Not counted: the interpreter's start before "
        "the command."
    ]


def skipped_lines(result: dict[str, Any]) -> list[str]:
    """Every part not measured, with why (the budget's estimates included)."""
    numerics = result["numerics"]["skipped"].items()
    lines = [f"- {'numerics' if part == 'all' else part}: {why}" for part, why in numerics]
    if result["timings_s"].get("speed_reps_cut"):
        lines.append(f"- speed: {result['timings_s']['speed_reps_cut']}")
    items = [(r["precision"], *skip) for r in result["precisions"] for skip in r["skipped"].items()]
    for names, part, why in concise.grouped_parts(items):  # one line for a shared reason
        if len(names) == 1:
            what = names[0] if part == "all" else f"{names[0]} {part}"
        else:
            what = concise.names_words(names)
            what = what if part == "all" else f"{part} of {what}"
        lines.append(f"- {what}: {why}")
    lines += layer_plan.skipped_lines(result["layer_plan"])
    return lines + confidence.skipped_lines(result.get("confidence"))


def render(result: dict[str, Any], console: bool = False) -> str:
    """advise.md: the recommendation first, then the evidence table, what was skipped, time.
    ``console``: the console's version, whose per-layer plan is a summary (its headline, runs
    and command, the first ranked layers; every layer's figures stay in advise.md)."""
    s = result["settings"]
    plan = (
        layer_plan.console_section(result["layer_plan"], ADVISE_MD)
        if console
        else layer_plan.section(result["layer_plan"], ADVISE_LAYERS_PNG)
    )
    lines = [
        f"# mptrain advise: {result['model']} on {result['dataset']}, batch {result['batch_size']}",
        "",
        f"{_where(result)}; torch {result['versions']['torch']}; {took_words(result)}.",
        "",
        *([cut, ""] if (cut := interrupted_line(result)) else []),
        *([busy, ""] if (busy := busy_line(result)) else []),
        *recommendation_lines(result),
        "",
        *fit_report.section(result.get("memory")),
        *plan,
        "## Evidence",
        "",
        "| " + " | ".join(headers(result)) + " |",
        "|" + "---|" * len(headers(result)),
        *("| " + " | ".join(cells) + " |" for cells in table_rows(result)),
        "",
        f"Speed: medians of {_reps_done(result)} repetitions of {_timed_steps(result)} steps after "
        f"{s['warmup_steps']} warm-up, precisions in rotated order, ratios paired per repetition "
        f"(evaluation excluded). Fidelity: {s['fidelity_steps']} steps per precision from FP32's "
        "initial weights and batches; relative difference of the mean loss over windows of a "
        f"tenth of the run (tolerance {s['tolerance']:.0%}).",
        _one_ulp_line(result["fp32_one_ulp_check"]),
        *([method] if (method := confidence.method_line(result.get("confidence"))) else []),
        *predict.lines(result.get("prediction")),
    ]
    skipped = skipped_lines(result)
    if skipped:
        lines += ["", "Not measured:", *skipped]
    lines += ["", *time_lines(result)]
    lines += ["", f"![loss and speed per precision]({ADVISE_PNG})"]
    return "\n".join(lines) + "\n"


def _reps_done(result: dict[str, Any]) -> int:
    timed = [r["speed"] for r in result["precisions"] if r["speed"]]
    return len(timed[0]["reps"]) if timed else 0


def _timed_steps(result: dict[str, Any]) -> int:
    return result["timings_s"].get("speed_steps", result["settings"]["speed_steps"])


def _where(result: dict[str, Any]) -> str:
    hw = result["hardware"]
    return hw["gpu"]["name"] if hw.get("gpu") else hw["cpu"]["model"]


# ------------------------------------------------------------------------------ out
def write(result: dict[str, Any], output_dir: Path, budget: Budget) -> None:
    """advise.png, then advise.json and advise.md with the time taken against ``budget`` (the
    figure included), each file written atomically."""
    started = time.perf_counter()
    from mptrain.output.plots import (  # matplotlib: most of the report's time
        plot_advice,
        plot_layer_plan,
    )

    output_dir.mkdir(parents=True, exist_ok=True)
    curves = {r["label"]: r["losses"] for r in result["precisions"] if r["losses"]}
    speeds = [
        (r["label"], r["speed"]["vs_fp32"], *r["speed"]["vs_fp32_range"])
        for r in result["precisions"]
        if r["speed"] and "vs_fp32" in r["speed"]
    ]
    title = f"mptrain advise: {result['model']} on {result['dataset']}"
    plot_advice(curves, speeds, title, output_dir / ADVISE_PNG)
    if rows := layer_plan.figure_rows(result["layer_plan"]):
        plot_layer_plan(
            rows,
            f"{title}: {result['layer_plan']['label']} per layer",
            output_dir / ADVISE_LAYERS_PNG,
            result["layer_plan"]["label"],
        )
    result["timings_s"][REPORT] = time.perf_counter() - started  # the files: milliseconds
    result["elapsed_s"] = budget.elapsed_s()
    atomic_write_text(output_dir / ADVISE_JSON, json.dumps(clean_json(result), indent=2) + "\n")
    atomic_write_text(output_dir / ADVISE_MD, render(result))


def _print_markdown(console: Console, lines: list[str], bold: str = "") -> None:
    """Markdown ``lines`` on a terminal: a bold line in bold (after ``bold``), without Markdown's
    fences (the command stands on its own line)."""
    for line in lines:
        if line.startswith("**"):
            console.print(f"[bold]{bold}{escape(line.strip('*'))}[/bold]")
        elif not line.startswith("```"):
            console.print(escape(line))


def show(console: Console, result: dict[str, Any], output_dir: Path) -> None:
    """The recommendation and the table: rich on a terminal, elsewhere advise.md's lines with
    the per-layer plan summarised (:func:`render`'s ``console``)."""
    if not console.is_terminal:
        lines = render(result, console=True).split("\n")  # the figures' links: advise.md's
        print("\n".join(line for line in lines if not line.startswith("![")).rstrip())
        print(f"advise written to {output_dir / ADVISE_MD}")
        return
    heads = [head for head in (interrupted_line(result), busy_line(result)) if head]
    lines = [*(x for head in heads for x in (head, "")), *recommendation_lines(result)]
    _print_markdown(console, lines)
    table = Table(title=f"evidence: {result['model']} on {result['dataset']}")
    for header in headers(result):
        table.add_column(header, overflow="fold")
    for cells in table_rows(result):
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    for line in predict.lines(result.get("prediction")) + fit_report.section(result.get("memory")):
        console.print(escape(line))
    plan = result["layer_plan"]  # as off a terminal, less its heading and last blank line
    if lines := layer_plan.console_section(plan, ADVISE_MD)[2:-1]:
        _print_markdown(console, lines, bold=f"{plan['label']} per layer: ")
    skipped = skipped_lines(result)
    for line in [*(["Not measured:", *skipped] if skipped else []), *time_lines(result)]:
        console.print(escape(line))
    console.print(f"advise written to {output_dir / ADVISE_MD}")
