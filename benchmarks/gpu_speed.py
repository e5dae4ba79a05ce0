"""The contention-free speed table: mptrain's GPT and ResNet-50 at every precision, compile off and on.

    python3 -m benchmarks.gpu_speed [--out speed_table.json] [--budget-s 180] [--models gpt,resnet50]
        [--precisions fp32,tf32,fp16,bf16,fp8,fp8_rowwise] [--compile off,on] [--compile-models M]
    python3 -m benchmarks.gpu_speed --device cpu --compile-backend aot_eager   # tiny, a smoke run

benchmarks/gpu_all.py runs it as its ``speed_table`` step, after the FP8 check and before
``pytest -m gpu``; BENCHMARKS.md holds its table. A cell is one model (gpu_gpt.py's GPT,
gpu_resnet50.py's ResNet-50) x precision (``tf32``: FP32 with TF32 matmuls allowed; ``fp8``: one
scale per tensor, ``fp8_rowwise``: one per row) x compile.

Each cell is mptrain's own training loop (``prepare_run``, ``train_loop``: what ``mptrain bench``
times; figures by bench's ``run_figures``), stopped by the loop's stop hook after its warm-up and
timed window, so no evaluation runs (compiled, it would compile the evaluation graph too). Per
cell: samples/s and tokens/s after warm-up (timed between device synchronisations), step time,
peak memory, the loss scaler's skipped steps (in the window, in all), the warm-up's seconds and,
compiled, the compile time: the warm-up's seconds beyond ``warmup`` x the step time (torch.compile
compiles in the first step, never in the throughput), with torch._dynamo's graphs and graph
breaks. GPT cells get MFU (gpu_gpt.py's FLOPs and peaks). Ratios: to the same model's eager FP32,
and compiled to eager at the same precision. torch._dynamo is reset after every cell, so its
recompile limit never turns a later cell eager.

Predicted vs measured: ``load_predictor`` is the hook: PREDICTOR's
``predict_samples_per_s(cfg: RunConfig) -> float`` (the roofline of the cell's precision on the
GPU it runs on), which each measured cell records with the ratio (or the reason there is none).

Budget: ``--budget-s`` counts from the script's start; cells run in order of value (every eager
cell, then the compiled ones by COMPILE_ORDER, the models alternating). A cell starts only when its
estimate fits in what is left (ESTIMATE_S until a cell of its model and mode ran, then the longest
such cell's wall time); one that does not fit is ``not run`` with the reason, and the next is
tried. A running cell stops between steps at CELL_CAP_S or the budget's end, keeping what its
window timed. After every cell the JSON (``--out``) and the markdown table (its path with ``.md``)
are rewritten atomically; SIGINT or SIGTERM (gpu_all's limit) records the running cell as stopped,
the rest as not run, writes both and exits 130/143.

``--device cpu`` runs the same code with tiny sizes in seconds (tests/e2e/test_benchmarks.py does);
``--compile-backend`` other than inductor (smoke runs: aot_eager) makes this process's
torch.compile use that backend, recorded in the document and the table's header.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import importlib
import importlib.util
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_gpt, gpu_resnet50
from benchmarks.jsondoc import error_text, write_json, write_text
from benchmarks.mptrain_api import (
    ConfigError,
    GPTShape,
    LoopHooks,
    RunConfig,
    compile_counts,
    contention,
    fp8_gemm_available,
    hardware_info,
    precision_config,
    prepare_run,
    run_figures,
    software_versions,
    train_loop,
)

MODELS = ("gpt", "resnet50")
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8", "fp8_rowwise")
COMPILE_ORDER = ("bf16", "fp8", "fp8_rowwise", "fp16", "tf32", "fp32")  # compiled cells' value
PREDICTOR = "mptrain.commands.advise.predict"  # the module the predictor hook looks for
# Per device: the models' sizes and timed windows (warm-up steps hold the compilation).
SIZES = {
    "cuda": {
        "gpt": {**gpu_gpt.SIZES["cuda"], "warmup": 3, "steps": 6},  # the window: shorter
        "resnet50": {"batch": 256, "image_size": 224, "warmup": 5, "steps": 12},
    },
    "cpu": {
        "gpt": {**gpu_gpt.SIZES["cpu"], "warmup": 2, "steps": 2},  # the window: shorter
        "resnet50": {"batch": 2, "image_size": 32, "warmup": 1, "steps": 1},
    },
}  # fmt: skip
# A cell's wall seconds before any cell of its model and mode ran (estimates: on an H200 none
# has run yet; FP32 GPT steps ~1 s, compiling ResNet-50 forward and backward ~1 min or more).
ESTIMATE_S = {
    "cuda": {("gpt", False): 15, ("gpt", True): 60, ("resnet50", False): 12, ("resnet50", True): 90},
    "cpu": {("gpt", False): 3, ("gpt", True): 10, ("resnet50", False): 5, ("resnet50", True): 15},
}  # fmt: skip
CELL_CAP_S = {"cuda": 150.0, "cpu": 60.0}  # one cell's most, checked between steps
BUDGET_S = {"cuda": 180.0, "cpu": 120.0}


class Stopped(BaseException):
    """SIGTERM while the table runs, as SIGINT's KeyboardInterrupt: no cell's error handler
    (``except Exception``) takes it for the cell's failure."""


def on_sigterm(signum: int, frame: object) -> None:
    raise Stopped("SIGTERM")


@dataclasses.dataclass
class Cell:
    """One model x precision x compile; ``status``: pending | ok | partial (stopped at its cap:
    fewer timed steps) | not run | refused (mptrain's ConfigError) | failed | stopped."""

    model: str
    precision: str
    compile: bool
    status: str = "pending"
    why: str | None = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[str, bool]:
        return self.model, self.compile

    def label(self) -> str:
        return f"{self.model} {self.precision} compile {'on' if self.compile else 'off'}"


def plan_cells(
    models: list[str], precisions: list[str], modes: list[bool], compiled: list[str]
) -> list[Cell]:
    """Every eager cell (model by model), then the compiled ones (of the ``compiled`` models) by
    COMPILE_ORDER, models alternating: the cheap, certain figures first, then compile's."""
    cells = [Cell(m, p, False) for m in models for p in precisions] if False in modes else []
    if True in modes:
        ordered = [p for p in COMPILE_ORDER if p in precisions]
        cells += [Cell(m, p, True) for p in ordered for m in models if m in compiled]
    return cells


def load_predictor() -> tuple[Callable[[RunConfig], float] | None, str]:
    """The hook for predicted figures: (``predict_samples_per_s`` of PREDICTOR, where it came
    from) when mptrain has that module; (None, why) until then."""
    if importlib.util.find_spec(PREDICTOR) is None:
        return None, f"no advise predictor yet ({PREDICTOR} does not exist): nothing predicted"
    return importlib.import_module(PREDICTOR).predict_samples_per_s, PREDICTOR


# ---------------------------------------------------------------------------------- one cell
def base_configs(device: torch.device, sizes: dict[str, dict]) -> dict[str, RunConfig]:
    """Each model's RunConfig as gpu_gpt.py and gpu_resnet50.py compose it (the shipped YAML)."""
    gpt = argparse.Namespace(**sizes["gpt"], device=device.type)
    resnet = argparse.Namespace(**sizes["resnet50"])
    return {"gpt": gpu_gpt.run_config(gpt), "resnet50": gpu_resnet50.run_config(resnet, device)}


def cell_config(base: RunConfig, cell: Cell) -> RunConfig:
    """``base`` at the cell's precision (bench's config for it) and compile setting."""
    name = "fp8" if cell.precision == "fp8_rowwise" else cell.precision
    granularity = "rowwise" if cell.precision == "fp8_rowwise" else "tensorwise"
    return dataclasses.replace(
        base,
        precision=precision_config(name, base.precision),
        fp8=dataclasses.replace(base.fp8, granularity=granularity),
        compile=cell.compile,
    )


def train_cell(cfg: RunConfig, warmup: int, steps: int, deadline: float) -> dict[str, Any]:
    """``warmup + steps`` optimizer steps of ``cfg`` through mptrain's loop, stopped by its stop
    hook after them (max_steps one beyond: the final evaluation never comes) or, between steps,
    at ``deadline`` (time.monotonic). Bench's figures plus the time split and skipped steps."""
    cfg = dataclasses.replace(
        cfg, max_steps=warmup + steps + 1, epochs=None, throughput_warmup_steps=warmup,
        log_every=max(steps, 1), eval_every=10**9,
    )  # fmt: skip
    before = compile_counts() if cfg.compile else None
    started = time.perf_counter()
    run = prepare_run(cfg)
    prepare_s = time.perf_counter() - started

    def stop() -> bool:  # asked after every step: the window is done, or the deadline passed
        return run.state.step >= warmup + steps or time.monotonic() >= deadline

    train_loop(run, LoopHooks(stop_requested=stop))
    figures = run_figures(run)
    window_s = run.monitor.throughput.measured_time_s
    measured = run.monitor.throughput.measured_steps
    warmup_s = run.monitor.time.training_s - window_s
    skipped = run.state.skipped_steps
    figures.update(
        steps_done=run.state.step, measured_steps=measured, planned_steps=steps,
        prepare_s=prepare_s, warmup_s=warmup_s, window_s=window_s,
        warmup_overhead_s=warmup_s - warmup * window_s / measured if measured else None,
        skipped_steps=len(skipped), skipped_in_window=sum(s > warmup for s in skipped),
        evaluations=run.monitor.time.evaluations,
    )  # fmt: skip
    if before is not None:
        after = compile_counts()
        figures["compile_s"] = figures["warmup_overhead_s"]
        figures["graphs"] = after["graphs"] - before["graphs"]
        figures["graph_breaks"] = after["graph_breaks"] - before["graph_breaks"]
    return figures


def release(device: torch.device) -> None:
    """What a cell left: its run's tensors, torch.compile's graphs (and recompile counts)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- the section
class Section:
    """The table's run: cells in plan order within the budget (see module doc). ``clock``
    (time.monotonic) and ``train`` (:func:`train_cell`) are a test's to replace."""

    def __init__(
        self, args: argparse.Namespace, configs: dict[str, RunConfig], doc: dict,
        clock: Callable[[], float] = time.monotonic, train: Callable[..., dict] = train_cell,
    ) -> None:  # fmt: skip
        self.args, self.configs, self.doc = args, configs, doc
        self.clock, self.train = clock, train
        self.deadline = clock() + args.budget_s
        self.cells = plan_cells(args.models, args.precisions, args.compile, args.compile_models)
        self.walls: dict[tuple[str, bool], float] = {}  # the longest cell by (model, compile)
        self.refused: dict[tuple[str, str], str] = {}  # (model, precision) -> ConfigError
        self.predict, doc["predictor"] = load_predictor()

    def estimate_s(self, cell: Cell) -> float:
        return self.walls.get(cell.key, ESTIMATE_S[self.args.device_type][cell.key])

    def run(self) -> None:
        """Every cell in turn, the documents rewritten after each; a stop (KeyboardInterrupt,
        :class:`Stopped`) marks the running cell stopped, the rest not run, and propagates."""
        running = None
        try:
            for running in self.cells:
                self.run_cell(running)
                self.write()
        except (KeyboardInterrupt, Stopped) as exc:
            why = f"the section was stopped ({type(exc).__name__}: gpu_all's limit or a person)"
            for cell in self.cells:
                if cell.status == "pending":
                    cell.status, cell.why = ("stopped" if cell is running else "not run"), why
            self.write()
            raise

    def run_cell(self, cell: Cell) -> None:
        refused = self.refused.get((cell.model, cell.precision))
        if refused:
            cell.status, cell.why = "refused", f"{refused} (as compile off)"
            return
        left, estimate = self.deadline - self.clock(), self.estimate_s(cell)
        if left < estimate:
            cell.status = "not run"
            cell.why = f"budget: {left:.0f} s of the section left, ~{estimate:.0f} s needed"
            return
        print(f"[gpu_speed] {cell.label()} ...", flush=True)
        self.measure(cell, min(self.deadline, self.clock() + self.args.cell_cap_s))
        print(f"[gpu_speed] {cell.label()}: {cell.status} {cell.why or ''}", flush=True)

    def measure(self, cell: Cell, deadline: float) -> None:
        started = self.clock()
        cfg = cell_config(self.configs[cell.model], cell)
        sizes = self.args.sizes[cell.model]
        try:
            cell.figures = self.train(cfg, sizes["warmup"], sizes["steps"], deadline)
        except ConfigError as exc:  # mptrain refuses it (FP8 with no Linear to convert)
            self.refused[cell.model, cell.precision] = str(exc)
            cell.status, cell.why = "refused", str(exc)
        except Exception as exc:  # recorded in the document; the other cells still run
            cell.status, cell.why = "failed", error_text(exc)
        else:
            self.judge(cell, cfg)
        finally:
            release(self.args.torch_device)
        cell.figures["wall_s"] = wall_s = self.clock() - started
        self.walls[cell.key] = max(self.walls.get(cell.key, 0.0), wall_s)

    def judge(self, cell: Cell, cfg: RunConfig) -> None:
        """ok, or partial (stopped at its cap) with what it timed; the predicted figure."""
        f = cell.figures
        f["emulated"] = cell.precision.startswith("fp8") and (
            "emulated" in f["label"] or not fp8_gemm_available(self.args.torch_device)
        )
        done, planned = f["measured_steps"], f["planned_steps"]
        cell.status = "ok" if done == planned else "partial"
        if done < planned:
            cell.why = f"stopped at its cap after {done} of {planned} timed steps"
        if self.predict is not None and f["samples_per_s"]:
            try:
                f["predicted_samples_per_s"] = self.predict(cfg)
            except Exception as exc:  # the predictor's error, recorded: the measurement stands
                f["predicted_error"] = error_text(exc)
            else:
                f["measured_over_predicted"] = f["samples_per_s"] / f["predicted_samples_per_s"]

    def write(self) -> None:
        self.doc["cells"] = [dataclasses.asdict(c) for c in self.cells]
        add_ratios(self.doc["cells"])
        add_mfu(self.doc)
        self.doc["not_run_for_budget"] = [
            c.label() for c in self.cells if c.status == "not run" and c.why.startswith("budget")
        ]
        self.doc["markdown"] = render(self.doc)
        write_json(self.args.out, self.doc)
        if self.args.out is not None:
            write_text(self.args.out.with_suffix(".md"), self.doc["markdown"])


# ----------------------------------------------------------------------------- derived figures
def measured(cell: dict) -> bool:
    return cell["status"] in ("ok", "partial") and bool(cell["figures"].get("samples_per_s"))


def add_ratios(cells: list[dict]) -> None:
    """``vs_fp32``: against the same model's eager FP32 cell; ``vs_eager`` (compiled cells):
    against the same model and precision eager. Only between measured cells."""
    eager = {(c["model"], c["precision"]): c for c in cells if measured(c) and not c["compile"]}
    for cell in filter(measured, cells):
        speed = cell["figures"]["samples_per_s"]
        fp32 = eager.get((cell["model"], "fp32"))
        cell["figures"]["vs_fp32"] = speed / fp32["figures"]["samples_per_s"] if fp32 else None
        same = eager.get((cell["model"], cell["precision"])) if cell["compile"] else None
        cell["figures"]["vs_eager"] = speed / same["figures"]["samples_per_s"] if same else None


def add_mfu(doc: dict) -> None:
    """GPT cells' MFU by gpu_gpt.py's rule (FP8 rowwise against the FP8 peak)."""
    for cell in doc["cells"]:
        if cell["model"] != "gpt" or not measured(cell):
            continue
        f = cell["figures"]
        row = {"precision": cell["precision"].removesuffix("_rowwise"),
               "tokens_per_s": f["tokens_per_s"], "emulated": f["emulated"]}  # fmt: skip
        gpu_gpt.add_mfu(row, doc["gpt_flops_per_token"], doc["mfu"])
        f.update(mfu=row["mfu"], mfu_vs_bf16_peak=row["mfu_vs_bf16_peak"], mfu_note=row["mfu_note"])


# ------------------------------------------------------------------------------- the markdown
COLUMNS = [
    "model", "precision", "compile", "samples/s", "tokens/s", "vs fp32 eager", "vs eager",
    "step ms", "peak memory", "skipped steps (window/all)", "compile s", "MFU",
    "predicted samples/s", "note",
]  # fmt: skip
TEXT_COLUMNS = ("model", "precision", "compile", "note")  # the others align right


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def cell_row(cell: dict) -> list[str]:
    """One markdown row: the figures of a measured cell, else dashes and why in the note."""
    name = cell["precision"] + (" (emulated)" if cell["figures"].get("emulated") else "")
    head = [cell["model"], name, "on" if cell["compile"] else "off"]
    note = "" if cell["status"] == "ok" else f"{cell['status']}: {cell['why']}"
    if not measured(cell):
        return [*head, *["-"] * (len(COLUMNS) - 4), note.replace("|", "/")]
    f = cell["figures"]
    peak = f["peak_memory_bytes"]
    return [
        *head, f"{f['samples_per_s']:,.1f}", number(f["tokens_per_s"], ",.0f"),
        number(f["vs_fp32"], ".2f"), number(f["vs_eager"], ".2f"), number(f["step_time_ms"], ".1f"),
        "-" if peak is None else f"{peak / 2**30:.2f} GiB",
        f"{f['skipped_in_window']}/{f['skipped_steps']}", number(f.get("compile_s"), ".1f"),
        number(f.get("mfu"), ".1%"), number(f.get("predicted_samples_per_s"), ",.1f"),
        note.replace("|", "/"),
    ]  # fmt: skip


def table_lines(cells: list[dict]) -> list[str]:
    rule = [" --- |" if name in TEXT_COLUMNS else " ---: |" for name in COLUMNS]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "".join(rule)]
    return lines + ["| " + " | ".join(cell_row(c)) + " |" for c in cells]


def render(doc: dict) -> str:
    """The table ready to paste into BENCHMARKS.md, with what its figures are."""
    hw = doc["hardware"]
    where = hw["gpu"]["name"] if hw.get("gpu") else f"CPU ({hw['cpu']['model']}; a smoke run)"
    machine = (doc.get("machine_load") or {}).get("words", "judged when the table ends")
    skipped = doc["not_run_for_budget"]
    lines = [
        f"Speed table, {doc['date']}: {where}; torch {doc['versions']['torch']}; machine: "
        f"{machine}; torch.compile backend {doc['compile_backend']}; {doc['budget_s']:.0f} s budget.",
        "",
        f"- GPT: {doc['models']['gpt']}",
        f"- ResNet-50: {doc['models']['resnet50']}",
        f"- {doc['timing']}",
        f"- Predicted: {doc['predictor']}",
        "- Not run for lack of budget: "
        + (f"{len(skipped)} cells ({'; '.join(skipped)})" if skipped else "none"),
        "",
        *table_lines(doc["cells"]),
    ]
    return "\n".join(lines) + "\n"


TIMING = (
    "samples/s and tokens/s after the warm-up, timed between device synchronisations, no "
    "evaluation; vs fp32 eager: against the same model's eager FP32 cell; vs eager: compiled "
    "against eager at the same precision; skipped steps: the loss scaler's, in the timed window "
    "and in all; compile s: the warm-up's seconds beyond warm-up steps x the step time (torch."
    "compile compiles in the first step; the first compiled cell's holds the compiler's imports), "
    "not in the throughput; MFU: gpu_gpt.py's model FLOPs over the precision's peak (GPT only)"
)


# ---------------------------------------------------------------------------------------- main
def document(args: argparse.Namespace) -> dict:
    """The JSON document before its cells: settings, hardware, the GPT's FLOPs and peaks."""
    g, r = args.sizes["gpt"], args.sizes["resnet50"]
    shape = GPTShape(gpu_gpt.VOCAB, g["block"], g["layers"], g["heads"], g["width"])
    hardware = hardware_info(args.torch_device)
    gpu_name = hardware["gpu"]["name"] if hardware.get("gpu") else None
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": args.device_type,
        "compile_backend": args.compile_backend,
        "budget_s": args.budget_s,
        "cell_cap_s": args.cell_cap_s,
        "models": {
            "gpt": f"width {g['width']}, {g['layers']} layers, {g['heads']} heads, block "
            f"{g['block']}, batch {g['batch']} ({g['batch'] * g['block']:,} tokens/step), byte "
            f"vocabulary, AdamW; {g['steps']} timed steps after {g['warmup']}",
            "resnet50": f"synthetic {r['image_size']} px, batch {r['batch']}, channels_last, SGD, "
            f"cudnn.benchmark off; {r['steps']} timed steps after {r['warmup']}",
        },
        "sizes": args.sizes,
        "timing": TIMING,
        "hardware": hardware,
        "versions": software_versions(),
        "gpt_flops_per_token": gpu_gpt.flops_per_token(shape),
        "mfu": gpu_gpt.peak_table(gpu_name, {}),
        "machine_load": None,  # judged when the table ends; then predictor, cells, markdown
    }


def choices(parser: argparse.ArgumentParser, flag: str, text: str, allowed: tuple) -> list[str]:
    names = [n for n in text.split(",") if n]
    if not names or set(names) - set(allowed):
        parser.error(f"{flag}: {text!r}: a comma-separated list of {', '.join(allowed)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the table) | cpu (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON; the table: .md beside")
    parser.add_argument("--budget-s", type=float, default=None, help="default 180 (cpu: 120)")
    parser.add_argument("--cell-cap-s", type=float, default=None, help="default 150 (cpu: 60)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--compile", default="off,on", help="off,on | off | on")
    parser.add_argument("--compile-models", default=None, help="default: --models (smoke: gpt)")
    parser.add_argument("--compile-backend", default="inductor", help="smoke runs: aot_eager")
    args = parser.parse_args(argv)
    args.device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    args.torch_device = torch.device(args.device)
    args.models = choices(parser, "--models", args.models, MODELS)
    args.precisions = choices(parser, "--precisions", args.precisions, PRECISIONS)
    args.compile = [m == "on" for m in choices(parser, "--compile", args.compile, ("off", "on"))]
    compiled = args.compile_models or ",".join(args.models)
    args.compile_models = choices(parser, "--compile-models", compiled, tuple(args.models))
    args.budget_s = args.budget_s or BUDGET_S[args.device_type]
    args.cell_cap_s = args.cell_cap_s or CELL_CAP_S[args.device_type]
    args.sizes = SIZES[args.device_type]
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when no cell failed (cells not run for budget or refused by mptrain are not
    failures: the table says why), 1 when one did, 130/143 when stopped, 2 without CUDA."""
    args = parse_args(argv)
    if args.device_type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.compile_backend != "inductor":  # mptrain's compile=true calls torch.compile(model)
        torch.compile = functools.partial(torch.compile, backend=args.compile_backend)
    doc = document(args)
    section = Section(args, base_configs(args.torch_device, args.sizes), doc)
    before = contention.sample()
    section.write()  # the plan, every cell pending, on disk before the first one runs
    code = 0
    try:
        section.run()
    except KeyboardInterrupt:
        code = 130
    except Stopped:
        code = 143
    doc["machine_load"] = contention.judged_since(before, args.torch_device)
    section.write()
    print(doc["markdown"], flush=True)
    return code or (1 if any(c.status == "failed" for c in section.cells) else 0)


if __name__ == "__main__":
    raise SystemExit(main())
