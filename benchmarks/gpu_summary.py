"""What gpu_all leaves behind: each step's :class:`Outcome`, pytest's tests by name (JUnit XML and
the ``-v`` log), the headline figures of every script's JSON document (the FP8 verdict, the
tables), ``summary.json`` and ``summary.md``, and the bundle of every other file.

``summary.json``: every step's exit code, wall time, JSON document and, for pytest, every test's
outcome. ``summary.md``: the steps table, headline figures with the speed table, every GPU test
by name with its outcome, the tail of each failed step's log. :func:`bundle` packs every file but
the two summaries and SPEED_TABLE_MD into BUNDLE (the device tool returns files only eight at a
time). Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.gpu_runs import REPO, Step
from benchmarks.jsondoc import first_line, write_json, write_text

BUNDLE = "gpu_all_files.tar.gz"
SPEED_TABLE_MD = "speed_table.md"  # left out of the bundle: the table to paste, read at once


@dataclass
class Outcome:
    """What one step did. ``status``: ok | failed (why) | timed out | stopped (why) | not run
    (why) | not run yet; ``partial``: its JSON document is what it wrote before it ended
    without success; ``tests``: a pytest step's tests, each with its outcome."""

    name: str
    what: str
    status: str
    exit_code: int | None = None
    wall_s: float = 0.0
    timeout_s: float | None = None
    log: str | None = None
    estimate_s: float | None = None
    partial: bool = False
    tests: list[dict] | None = None
    result: dict | None = field(default=None, repr=False)


def collect(step: Step, out: Path, outcome: Outcome) -> Outcome:
    """Read what a step that ran left, whatever its status: its JSON document (``partial``
    unless it ended ok; one that ended ok without a readable document failed) and a pytest
    step's tests (one that must pass fails when none passed)."""
    outcome.estimate_s = step.estimate_s
    if step.junit:
        outcome.tests = step_tests(out / step.junit, out / f"{step.name}.log")
        if step.must_pass and outcome.status == "ok" and tally(outcome.tests)["passed"] == 0:
            outcome.status = f"failed (no test passed: {tally_text(outcome.tests)})"
    if step.json_out:
        try:
            outcome.result = json.loads((out / step.json_out).read_text())
        except (OSError, ValueError) as exc:
            if outcome.status == "ok":
                outcome.status = f"failed (no JSON document: {exc})"
        else:
            outcome.partial = outcome.status != "ok"
    return outcome


# ------------------------------------------------------------------------------ pytest's tests
def node_id(classname: str, name: str) -> str:
    """pytest's node id (``tests/e2e/test_gpu.py::test_x[fp16]``) of a JUnit ``testcase``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (REPO / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


JUNIT_OUTCOMES = {"error": "error", "failure": "failed", "skipped": "skipped"}


def junit_tests(xml_path: Path) -> list[dict] | None:
    """Every ``testcase`` of pytest's JUnit XML: test (node id), outcome (passed | failed | error
    | skipped), time_s, message (first line); None when the file is missing or broken."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        if not case.get("name"):  # the test a SIGINT interrupted: a nameless entry
            continue
        marks = {child.tag: child for child in case if child.tag in JUNIT_OUTCOMES}
        tag = next((t for t in JUNIT_OUTCOMES if t in marks), None)  # error outranks failure
        tests.append({
            "test": node_id(case.get("classname", ""), case.get("name", "")),
            "outcome": JUNIT_OUTCOMES[tag] if tag else "passed",
            "time_s": float(case.get("time") or 0.0),
            "message": first_line(marks[tag].get("message", "")) if tag else "",
        })  # fmt: skip
    return tests


VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)?")


def log_tests(log: Path) -> list[dict]:
    """The tests ``pytest -v`` named in its log, with their outcomes; a test named without one
    (it was running when the step was stopped) is ``running when stopped``."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    tests: dict[str, str] = {}
    for line in lines:
        found = VERBOSE_LINE.match(line)
        if found:
            word = (found.group(2) or "").lower()
            outcome = {"xfail": "skipped", "xpass": "passed"}.get(word, word)
            tests[found.group(1)] = outcome or "running when stopped"
    return [{"test": t, "outcome": o, "time_s": None, "message": ""} for t, o in tests.items()]


def same_test(node: str) -> str:
    """What identifies a test in the XML and in the log alike: its module's name and the rest
    (the log's path is relative to the working directory, the XML's module to pytest's root)."""
    where, _, rest = node.partition("::")
    return f"{where.removesuffix('.py').replace('/', '.').split('.')[-1]}::{rest}"


def step_tests(xml_path: Path, log: Path) -> list[dict]:
    """A pytest step's tests: the JUnit XML's, plus those only its ``-v`` log names (the test
    a SIGINT interrupted; all of them when a hard kill left no XML)."""
    tests = junit_tests(xml_path) or []
    known = {same_test(t["test"]) for t in tests}
    return tests + [t for t in log_tests(log) if same_test(t["test"]) not in known]


def tally(tests: list[dict] | None) -> dict[str, int]:
    counts = dict.fromkeys(("passed", "failed", "error", "skipped", "running when stopped"), 0)
    for test in tests or []:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return counts


def tally_text(tests: list[dict] | None) -> str:
    counts = tally(tests)
    text = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "running when stopped")
    return f"{text} (of {len(tests or [])} reported)"


def test_lines(outcomes: list[Outcome]) -> list[str]:
    """Every test of every pytest step, by name, with its outcome (and why, when not passed)."""
    lines = []
    for outcome in outcomes:
        if outcome.tests is None:
            continue
        lines += ["", f"## Tests of {outcome.name}: {tally_text(outcome.tests)}", ""]
        for test in outcome.tests:
            took = "" if test["time_s"] is None else f" ({test['time_s']:.1f} s)"
            why = f": {test['message']}" if test["message"] else ""
            lines.append(f"- `{test['test']}`: {test['outcome']}{took}{why}")
    return lines


# ------------------------------------------------------------------------------ headline figures
FP8_AGREE_DB = 40.0  # real vs emulated FP8 GEMM: far closer than FP8 is to FP32 (~10-40 dB)


def fp8_verdict(doc: dict) -> tuple[str, str]:
    """(PASS | FAIL | INCOMPLETE, the reading): PASS when every GEMM agrees with the emulation
    (SQNR >= FP8_AGREE_DB), every planned training variant ran and every loss is finite."""
    # the block-scaled GEMMs the GPU has count like the others; skipped ones (no kernel) do not
    blocks = [g for g in doc.get("block_gemms") or [] if "skipped" not in g]
    gemms = (doc.get("gemm_agreement") or []) + blocks
    sqnrs = [g["real_vs_emulated_sqnr_db"] for g in gemms if "error" not in g]
    raised = len(gemms) - len(sqnrs)
    lowest = min(sqnrs, default=float("nan"))
    text = f"_scaled_mm vs emulation, lowest SQNR {lowest:.1f} dB (pass: >= {FP8_AGREE_DB:.0f} dB)"
    text += f", {raised} GEMMs raised" if raised else ""
    training = doc.get("training")
    if raised or not sqnrs or not lowest >= FP8_AGREE_DB:
        return "FAIL", text
    if not training:
        return "INCOMPLETE", f"{text}; no training variant finished"
    finite = training["all_losses_finite"]
    text += f"; losses finite: {finite}"
    if training["failed"] or not finite:
        return "FAIL", text
    done = len(training["variants"]) + len(training["failed"])
    if done < len(training.get("planned", training["variants"])):
        return "INCOMPLETE", f"{text}; {done} of {len(training['planned'])} variants finished"
    return "PASS", text


def fp8_lines(doc: dict) -> list[str]:
    """The FP8 check's verdict, each FP8 variant's speed against BF16 in the same mode (with
    the compiled ones' graph breaks) and the forward GEMM speeds."""
    verdict, text = fp8_verdict(doc)
    lines = [f"- FP8 check: **{verdict}**: {text}"]
    training = doc.get("training") or {"variants": {}, "vs_bf16": {}, "failed": {}}
    variants = training["variants"]
    if variants:
        lines.append(
            f"- FP8 vs BF16 training ({training['model']}, compiled with "
            f"{training['compile_backend']}; use_fast_accum: false):"
        )
    for name, row in training["vs_bf16"].items():
        lines.append(
            f"  - {name}: {variants[name]['samples_per_s']:.0f} vs {row['vs']} "
            f"{variants[row['vs']]['samples_per_s']:.0f} samples/s (x{row['speedup']:.2f}); "
            f"loss curves' mean abs diff {row['loss_curve_mean_abs_diff']:.4f}"
        )
    lines += [
        f"  - {name}: {row['graph_breaks']} graph breaks, {row['graphs']} graphs"
        + (f" ({'; '.join(row['graph_break_reasons'])})" if row["graph_breaks"] else "")
        for name, row in variants.items()
        if "graph_breaks" in row
    ]
    lines += [f"  - {name} FAILED: {why}" for name, why in training["failed"].items()]
    lines += forward_gemm_lines(doc.get("forward_gemm") or [])
    lines += block_gemm_lines(doc.get("block_gemms") or [])
    if doc.get("note"):
        lines.append(f"  - note: {doc['note']}")
    return lines


def forward_gemm_lines(rows: list[dict]) -> list[str]:
    lines = ["- FP8 forward GEMM vs BF16 (speed-up; fast accumulation: torchao's forward):"]
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        if row.get("error"):
            lines.append(f"  - {shape} {row['granularity']}: {row['error']}")
            continue
        lines.append(
            f"  - {shape} {row['granularity']}: BF16 {row['tflops']['bf16']:.1f} TFLOP/s; FP8 "
            f"x{row['fp8_speedup_vs_bf16']:.2f} (use_fast_accum false), "
            f"x{row['fp8_fast_accum_speedup_vs_bf16']:.2f} (true; SQNR vs emulation "
            f"{row['fast_accum_vs_emulated_sqnr_db']:.1f} dB)"
        )
    return lines if rows else []


def block_gemm_lines(rows: list[dict]) -> list[str]:
    lines = ["- Block-scaled GEMMs, real (scaled_mm) vs emulated:"]
    for row in rows:
        name = f"{row['format']} {'x'.join(map(str, row['shape']))}"
        if row.get("skipped") or row.get("error"):
            lines.append(f"  - {name}: {row.get('skipped') or row['error']}")
            continue
        lines.append(
            f"  - {name}: SQNR vs emulation {row['real_vs_emulated_sqnr_db']:.1f} dB; "
            f"{row['tflops']['real']:.1f} TFLOP/s (x{row['real_speedup_vs_emulated']:.1f} the "
            f"emulation, x{row['real_speedup_vs_bf16']:.2f} BF16)"
        )
    return lines if rows else []


def ratio(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2f}"


def memory(row: dict) -> str:
    peak = row.get("peak_memory_bytes")
    return "-" if peak is None else f"{peak / 2**30:.2f} GiB"


def resnet50_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | precision | img/s | vs fp32 | peak memory |"]
    lines.append("  | --- | ---: | ---: | ---: |")
    for row in doc["rows"]:
        name = f"{row['precision']}{' + cudnn.benchmark' if row.get('cudnn_benchmark') else ''}"
        if row.get("error"):
            lines.append(f"  | {name} | {row['error']} | - | - |")
            continue
        lines.append(
            f"  | {name} | {row['samples_per_s']:.1f} | {ratio(row, 'vs_fp32')} | {memory(row)} |"
        )
    return [*lines, "", f"  reference: {doc['reference']}", ""]


def mfu_text(row: dict) -> str:
    if row["mfu"] is None and row["mfu_vs_bf16_peak"] is None:
        return "emulated FP8: none" if row["emulated"] else "-"
    own = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    vs_bf16 = "-" if row["mfu_vs_bf16_peak"] is None else f"{row['mfu_vs_bf16_peak']:.1%}"
    return f"{own} ({vs_bf16} of BF16 peak)"


def gpt_lines(doc: dict) -> list[str]:
    """The GPT benchmark's table: tokens/s, ratio to FP32, MFU (own peak; BF16 peak), memory."""
    lines = [
        f"- {doc['benchmark']}:",
        "",
        "  | precision | tokens/s | vs fp32 | MFU | peak memory |",
        "  | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in doc["rows"]:
        if row.get("error"):
            lines.append(f"  | {row['precision']} | {row['error']} | - | - | - |")
            continue
        name = f"{row['precision']}{' (emulated)' if row['emulated'] else ''}"
        lines.append(
            f"  | {name} | {row['tokens_per_s']:,.0f} | {ratio(row, 'vs_fp32')} | "
            f"{mfu_text(row)} | {memory(row)} |"
        )
    flops, mfu_doc = doc["flops"], doc["mfu"]
    lines.append(
        f"\n  MFU: {flops['per_token']:,} FLOP/token ({flops['formula']}) x tokens/s "
        f"over the precision's dense peak, in brackets over the BF16 peak "
        f"({mfu_doc['source'] or mfu_doc['unknown_reason']})"
    )
    return [*lines, ""]


def decoder_text(row: dict) -> str:
    """The pipeline's decoder, and how many JPEGs the host decoded for device decoding: when
    nvJPEG refused them, the figure is partly (or wholly) the host's."""
    decoder = (row.get("pipeline") or {}).get("decoder", "-")
    host = row.get("host_decoded")
    return decoder if not host else f"{decoder}; {host} JPEGs host-decoded (nvJPEG refused them)"


def imagefolder_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | pipeline | img/s | data wait | decoder |"]
    lines.append("  | --- | ---: | ---: | --- |")
    for label, row in doc["pipelines"].items():
        if row.get("error"):
            lines.append(f"  | {label} | {row['error']} | - | - |")
            continue
        wait = row["data_wait_fraction"]
        wait_text = "-" if wait is None else f"{wait:.1%}"
        rate = "-" if row["images_per_s"] is None else f"{row['images_per_s']:.1f}"
        lines.append(f"  | {label} | {rate} | {wait_text} | {decoder_text(row)} |")
    if doc.get("note"):
        lines.append(f"\n  note: {doc['note']}")
    return [*lines, ""]


def data_path_lines(doc: dict) -> list[str]:
    host = doc.get("host_decoded") or {}
    rates = ", ".join(
        f"{name} {row['images_per_s']['median']:.0f} (median of {len(row['reps'])})"
        + (f", {host[name]} JPEGs host-decoded" if host.get(name) else "")
        for name, row in doc["pipelines"].items()
    )
    failed = [f"{name} FAILED: {why}" for name, why in (doc.get("errors") or {}).items()]
    return [f"- data path alone (images/s): {rates or 'none timed'}", *[f"  - {f}" for f in failed]]


def speed_lines(doc: dict) -> list[str]:
    """The speed table as gpu_speed.py rendered it (after every cell), under a heading."""
    return ["", f"### Speed table ({SPEED_TABLE_MD})", "", *doc["markdown"].splitlines(), ""]


HEADLINES = {
    "fp8_check": fp8_lines,
    "speed_table": speed_lines,
    "resnet50": resnet50_lines,
    "gpt": gpt_lines,
    "imagefolder_train": imagefolder_lines,
    "data_path": data_path_lines,
}


def headlines(outcomes: list[Outcome]) -> list[str]:
    """The headline figures of every step that produced them (partial ones marked); a failed
    reading says so."""
    lines = []
    for outcome in outcomes:
        if outcome.tests is not None:
            lines.append(f"- {outcome.name}: {tally_text(outcome.tests)}")
        elif outcome.result is not None and outcome.name in HEADLINES:
            if outcome.partial:
                lines.append(f"- {outcome.name}: PARTIAL figures (the step {outcome.status}):")
            try:
                lines.extend(HEADLINES[outcome.name](outcome.result))
            except (KeyError, TypeError, ValueError) as exc:
                lines.append(f"- {outcome.name}: cannot read its JSON document ({exc!r})")
        elif outcome.name in HEADLINES:
            lines.append(f"- {outcome.name}: no figures ({outcome.status})")
    return lines


# ------------------------------------------------------------------------------------- summary
def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path.name}: {exc})"


def failed(outcome: Outcome) -> bool:
    return outcome.status != "ok" and not outcome.status.startswith("not run")


def summary_md(outcomes: list[Outcome], out: Path, meta: dict) -> str:
    """summary.md: the steps table, the headline figures, every test by name, the tail of every
    failed step's log."""
    lines = [
        f"# GPU run {meta['date']}{' (CPU smoke run)' if meta['smoke'] else ''}",
        "",
        f"{meta['verdict']}; {meta['total_s']:.0f} s of a {meta['budget_s']:.0f} s budget; "
        f"python {meta['python']}; commit {meta['commit']}",
        "",
        "| step | what | status | exit | wall s | limit s | estimate s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        code = "-" if o.exit_code is None else str(o.exit_code)
        limit = "-" if o.timeout_s is None else f"{o.timeout_s:.0f}"
        estimate = "-" if o.estimate_s is None else f"{o.estimate_s:.0f}"
        status = f"{o.status}, partial figures" if o.partial else o.status
        lines.append(
            f"| {o.name} | {o.what} | {status} | {code} | {o.wall_s:.1f} | {limit} | {estimate} |"
        )
    lines += ["", "## Headline figures", "", *headlines(outcomes), *test_lines(outcomes)]
    for o in filter(failed, outcomes):
        lines += ["", f"## {o.name}: {o.status} (last lines of {o.log})", "", "```"]
        lines += [tail(out / o.log) if o.log else "(no log)", "```"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") or "unknown"


def write_summary(outcomes: list[Outcome], out: Path, meta: dict) -> None:
    """summary.json and summary.md, each written atomically."""
    write_json(out / "summary.json", {**meta, "steps": [asdict(o) for o in outcomes]})
    write_text(out / "summary.md", summary_md(outcomes, out, meta))


def bundle(out: Path) -> None:
    """Pack every file of ``out`` but summary.md/summary.json/SPEED_TABLE_MD into BUNDLE (written whole, then
    renamed), then remove the packed files."""
    keep = {"summary.md", "summary.json", BUNDLE, SPEED_TABLE_MD}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name not in keep)
    partial = out / f".{BUNDLE}.tmp"
    with tarfile.open(partial, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)))
    os.replace(partial, out / BUNDLE)
    for path in files:
        path.unlink()
