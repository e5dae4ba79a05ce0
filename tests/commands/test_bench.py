"""``mptrain bench``: which precisions are timed where, the figures and ratios it reports, the files
it writes, and its command line (CPU-only; the CUDA rows are checked with the device facts faked).
"""

from __future__ import annotations

import io
import json
import math
import statistics

import pytest
import torch
from rich.console import Console
from support.processes import describe, run_mptrain
from support.runs import compose_run, run_cli, tiny_run

from mptrain.commands import bench
from mptrain.config.base import ConfigError
from mptrain.config.precision import PrecisionConfig
from mptrain.platform import hardware
from mptrain.report.rows import fmt_bytes
from mptrain.train.build import prepare_run
from mptrain.train.memory import account_step

CPU = torch.device("cpu")


def skipped(rows: list[tuple[str, str | None]]) -> dict[str, str | None]:
    return dict(rows)


def test_cpu_precisions_skip_what_would_not_be_a_speed(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    conv = skipped(bench.bench_precisions(CPU, model_has_convs=True, block_formats=True))
    linear = skipped(bench.bench_precisions(CPU, model_has_convs=False))

    assert list(conv) == ["fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]  # no TF32 on a CPU
    assert conv["fp32"] is None and conv["bf16"] is None
    assert "FP16 convolutions" in conv["fp16"]
    assert linear["fp16"] is None  # Linear-only models time FP16 on the CPU
    assert "emulated" in conv["fp8"]
    assert conv["mxfp8"] == "no MXFP8 hardware: emulated MXFP8 is not a speed"
    assert conv["nvfp4"] == "no NVFP4 hardware: emulated NVFP4 is not a speed"

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert "no native BF16" in skipped(bench.bench_precisions(CPU, False))["bf16"]


@pytest.mark.parametrize(("native_bf16", "fp8_gemm"), [(True, True), (False, False)])
def test_cuda_precisions_include_tf32_and_what_the_gpu_has(monkeypatch, native_bf16, fp8_gemm):
    monkeypatch.setattr(hardware, "cuda_has_native_bf16", lambda device: native_bf16)
    monkeypatch.setattr(bench, "fp8_gemm_available", lambda device: fp8_gemm)
    rows = skipped(bench.bench_precisions(torch.device("cuda"), True, block_formats=True))

    assert list(rows) == ["fp32", "tf32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4"]
    assert rows["fp32"] is None and rows["tf32"] is None and rows["fp16"] is None
    assert (rows["bf16"] is None) == native_bf16
    assert (rows["fp8"] is None) == fp8_gemm
    # A GPU without block-scaled kernels (the answer is faked: this test also runs on GPUs that
    # have them): emulated, never timed
    no_kernel = "no real GEMM here"
    monkeypatch.setattr(bench, "block_gemm_available", lambda *_: (False, no_kernel))
    rows = skipped(bench.bench_precisions(torch.device("cuda"), True, block_formats=True))
    assert rows["mxfp8"] == f"{no_kernel}: emulated MXFP8 is not a speed"
    assert rows["nvfp4"] == f"{no_kernel}: emulated NVFP4 is not a speed"
    blockwise = skipped(bench.bench_precisions(torch.device("cuda"), True, fp8_blockwise=True))
    assert "mxfp8" not in blockwise  # mptrain advise (its own list) takes them later
    assert blockwise["fp8"] == f"{no_kernel}: emulated blockwise FP8 is not a speed"
    # ... and one with them: timed like any other row
    monkeypatch.setattr(bench, "block_gemm_available", lambda *_: (True, ""))
    rows = skipped(bench.bench_precisions(torch.device("cuda"), True, block_formats=True))
    assert rows["mxfp8"] is None and rows["nvfp4"] is None


def test_precision_config_per_bench_row():
    base = PrecisionConfig()
    tf32 = bench.precision_config("tf32", base)
    fp16 = bench.precision_config("fp16", base)
    bf16 = bench.precision_config("bf16", base)

    assert (tf32.name, tf32.allow_tf32) == ("fp32", True)
    assert (fp16.name, fp16.allow_tf32, bf16.name) == ("fp16", False, "bf16")
    assert fp16.scaler == base.scaler and fp16.scaler is not base.scaler
    assert not bench.precision_config("fp32", base).allow_tf32


def test_run_bench_measures_every_cpu_precision_and_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    cfg = tiny_run("model=mlp", "model.hidden_sizes=[16]", "device=cpu")
    console = Console(record=True, width=160)

    rows = bench.run_bench(cfg, tmp_path / "bench", warmup=2, steps=3, reps=3, console=console)

    by_name = {r["precision"]: r for r in rows}
    assert list(by_name) == ["fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4"]
    assert "skipped" in by_name["fp8"] and "reps" not in by_name["fp8"]
    measured = [by_name[name] for name in ("fp32", "bf16", "fp16")]
    fp32_speeds = [rep["samples_per_s"] for rep in by_name["fp32"]["reps"]]
    for row in measured:
        assert len(row["reps"]) == 3, row
        speeds = [rep["samples_per_s"] for rep in row["reps"]]
        assert row["samples_per_s"] == statistics.median(speeds)
        assert row["samples_per_s_range"] == [min(speeds), max(speeds)]
        for rep in row["reps"]:
            assert rep["samples_per_s"] > 0 and rep["step_time_ms"] > 0, rep
            assert 0 <= rep["data_wait_fraction"] < 1, rep
            # samples/s and step time come from the same stopwatch: batch / step time.
            expected = cfg.batch_size / (rep["step_time_ms"] / 1000)
            assert math.isclose(rep["samples_per_s"], expected, rel_tol=1e-9), rep
        # Each repetition's ratio is against the FP32 measurement of the same repetition.
        ratios = [s / b for s, b in zip(speeds, fp32_speeds, strict=True)]
        if row["precision"] != "fp32":
            assert [rep["vs_fp32"] for rep in row["reps"]] == ratios
            assert row["vs_fp32"] == statistics.median(ratios)
            assert row["vs_fp32_range"] == [min(ratios), max(ratios)]
            # noisy: the repetitions spread, or the machine was busy (other work on the cores)
            noisy = row["vs_fp32_noisy"]
            assert noisy is None or "spread" in noisy or "busy machine" in noisy, noisy
    assert (by_name["fp32"]["vs_fp32"], by_name["fp32"]["vs_fp32_noisy"]) == (1.0, None)
    # FP16: the scaler's inf check, the new scale, the loss's finiteness (see mptrain.train.loop)
    assert [r["host_syncs_per_step"] for r in measured] == [0, 0, 1]
    assert by_name["fp16"]["label"] and by_name["bf16"]["label"]

    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert written["rows"] == rows
    assert (written["warmup_steps"], written["measured_steps"], written["reps"]) == (2, 3, 3)
    text = (tmp_path / "bench" / "bench.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header and one line per precision
    assert "skipped: no FP8 hardware" in text
    bf16_line = next(line for line in table if line.startswith(f"| {by_name['bf16']['label']} "))
    low, high = by_name["bf16"]["vs_fp32_range"]
    assert f"{by_name['bf16']['vs_fp32']:.2f}× ({low:.2f}–{high:.2f})" in bf16_line
    assert ("noisy" in bf16_line) == bool(by_name["bf16"]["vs_fp32_noisy"])
    # One step's count beside the peak (memory.account is on by default): the same every rep.
    assert "| peak memory | activations | accounted | data wait |" in table[0]
    for row in measured:
        assert 0 < row["activation_bytes"] < row["accounted_bytes"], row
        assert {rep["accounted_bytes"] for rep in row["reps"]} == {row["accounted_bytes"]}
        line = next(line for line in table if line.startswith(f"| {row['label']} "))
        cells = [c.strip() for c in line.strip("| ").split(" | ")]
        assert cells[-4:-2] == [
            fmt_bytes(row["activation_bytes"]),
            fmt_bytes(row["accounted_bytes"]),
        ]
    fp8_line = next(line for line in table if line.startswith("| fp8 "))
    assert fp8_line.count("|") == table[0].count("|")  # skipped rows keep the column count
    printed = console.export_text()
    assert "vs fp32 (min–max)" in printed and "Medians of 3 repetitions" in printed
    # A classifier has no tokens: no tokens/s column, no tokens/s figures in its rows.
    assert "tokens/s" not in text and "tokens/s" not in printed
    assert written["task"] == "classify" and written["tokens_per_sample"] is None
    assert not any("tokens_per_s" in row for row in rows)


@pytest.mark.slow
def test_lm_bench_reports_tokens_per_s_as_samples_per_s_times_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)  # fp32 and fp16 timed
    block = 32
    cfg = compose_run(
        "task=lm", "device=cpu", "progress=false", "model.layers=1", "model.heads=2",
        "model.width=32", f"model.block_size={block}", "dataset.max_bytes=60000",
        "dataset.val_windows=8", "batch_size=8", "eval_batch_size=32",
    )  # fmt: skip
    console = Console(record=True, width=200)

    rows = bench.run_bench(cfg, tmp_path, warmup=1, steps=2, reps=2, console=console)

    measured = [r for r in rows if "reps" in r]
    assert [r["precision"] for r in measured] == ["fp32", "fp16"]
    for row in measured:
        for rep in row["reps"]:
            assert rep["tokens_per_s"] > 0
            assert math.isclose(rep["tokens_per_s"], rep["samples_per_s"] * block, rel_tol=1e-12)
        tokens = [rep["tokens_per_s"] for rep in row["reps"]]
        assert math.isclose(row["tokens_per_s"], row["samples_per_s"] * block, rel_tol=1e-12)
        assert row["tokens_per_s_range"] == [min(tokens), max(tokens)]
    written = json.loads((tmp_path / "bench.json").read_text())
    assert (written["task"], written["tokens_per_sample"]) == ("lm", block)
    assert written["rows"] == rows
    text = (tmp_path / "bench.md").read_text()
    assert f"batch 8 x {block} tokens" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert "| samples/s (min–max) | tokens/s (min–max) | vs fp32 (min–max) |" in table[0]
    for row in measured:
        line = next(line for line in table if line.startswith(f"| {row['label']} "))
        low, high = row["tokens_per_s_range"]
        assert f"| {row['tokens_per_s']:,.0f} ({low:,.0f}–{high:,.0f}) |" in line
    skipped_line = next(line for line in table if line.startswith("| fp8 "))
    assert skipped_line.count("|") == table[0].count("|")  # skipped rows keep the column count
    printed = console.export_text()
    assert "tokens/s (min–max)" in printed and f"{measured[0]['tokens_per_s']:,.0f}" in printed


def test_bench_counts_the_bytes_account_step_counts_on_the_same_config():
    figures, accounted = {}, {}
    for name in ("fp32", "bf16"):
        cfg = tiny_run("model.hidden_sizes=[16]", f"precision={name}")
        figures[name] = bench.measure(cfg, warmup=1, steps=1)
        accounted[name] = account_step(prepare_run(cfg))

    for name, counted in accounted.items():
        assert figures[name]["activation_bytes"] == counted["total"]["activations"] > 0
        assert figures[name]["accounted_bytes"] == counted["total_bytes"]
    fp32, bf16 = figures["fp32"], figures["bf16"]
    # Autocast saves the Linear layers' inputs in BF16: fewer activation bytes; the rest grows
    # by the BF16 copies of the weights it saved (parameter casts), which FP32 has none of.
    assert bf16["activation_bytes"] < fp32["activation_bytes"]
    rest = {name: f["accounted_bytes"] - f["activation_bytes"] for name, f in figures.items()}
    assert rest["bf16"] - rest["fp32"] == accounted["bf16"]["total"]["parameter_casts"] > 0


def test_memory_account_false_counts_nothing_and_the_cells_say_n_a(monkeypatch):
    def not_called(run):
        raise AssertionError("account_step ran with memory.account=false")

    monkeypatch.setattr(bench, "account_step", not_called)
    figures = bench.measure(tiny_run("memory.account=false"), warmup=1, steps=1)

    assert (figures["activation_bytes"], figures["accounted_bytes"]) == (None, None)
    row = bench.summarise("fp32", [figures])
    assert (row["activation_bytes"], row["accounted_bytes"]) == (None, None)
    bench.add_ratios([row])
    headers, cells = bench._headers(False), bench._cells(row, False)
    shown = dict(zip(headers, cells, strict=True))
    assert (shown["activations"], shown["accounted"]) == ("n/a", "n/a")
    assert shown["peak memory"] != "n/a"  # the peak is still measured


def test_a_row_carries_the_first_repetition_that_counted_and_skipped_rows_are_padded():
    counted = {"activation_bytes": 3 * 1024, "accounted_bytes": 10 * 1024}
    reps = [fake_rep(100), {**fake_rep(110), **counted}, {**fake_rep(90), **counted}]

    row = bench.summarise("fp32", reps)
    bench.add_ratios([row])

    assert (row["activation_bytes"], row["accounted_bytes"]) == (3072, 10240)
    for has_tf32, has_tokens in [(False, False), (True, False), (False, True), (True, True)]:
        headers = bench._headers(has_tf32, has_tokens)
        skipped = bench._cells({"precision": "fp8", "skipped": "why"}, has_tf32, has_tokens)
        assert len(skipped) == len(headers)
    row["tokens_per_s"], row["tokens_per_s_range"] = 1.0, [1.0, 1.0]
    shown = dict(zip(bench._headers(True, True), bench._cells(row, True, True), strict=True))
    assert (shown["peak memory"], shown["activations"], shown["accounted"]) == (
        "1000 B",
        "3.0 KiB",
        "10.0 KiB",
    )


def fake_rep(samples_per_s: float) -> dict:
    return {
        "samples_per_s": samples_per_s,
        "step_time_ms": 64_000 / samples_per_s,
        "peak_memory_bytes": 1000,
        "data_wait_fraction": 0.01,
        "host_syncs_per_step": 0,
        "label": "x",
    }


def bench_rows(speeds: dict[str, list[float]]) -> list[dict]:
    rows = [bench.summarise(name, [fake_rep(s) for s in reps]) for name, reps in speeds.items()]
    bench.add_ratios(rows)
    return rows


def test_ratios_pair_each_repetition_and_a_wide_spread_is_noisy():
    # A machine that slowed down in repetition 2: both precisions at half speed. Paired ratios
    # cancel it (tight: 2x every time); the samples/s ranges show it.
    _, tight = bench_rows({"fp32": [100, 50, 100], "bf16": [200, 100, 200]})
    assert (tight["vs_fp32"], tight["vs_fp32_range"], tight["vs_fp32_noisy"]) == (2, [2, 2], None)
    assert tight["samples_per_s_range"] == [100, 200]
    assert [rep["vs_fp32"] for rep in tight["reps"]] == [2, 2, 2]

    # 0.08x and 4.85x in different repetitions (the reading): noisy, with the reason.
    _, wide = bench_rows({"fp32": [100, 100, 100], "fp16": [8, 361, 485]})
    assert wide["vs_fp32"] == pytest.approx(3.61)
    assert wide["vs_fp32_range"] == pytest.approx([0.08, 4.85])
    assert "spread 132% of the median over 3 repetitions" in wide["vs_fp32_noisy"]

    # Within 10 % of the median is tight; beyond it is noisy.
    _, edge = bench_rows({"fp32": [100, 100, 100], "bf16": [95, 100, 104]})
    assert edge["vs_fp32_noisy"] is None
    _, over = bench_rows({"fp32": [100, 100, 100], "bf16": [94, 100, 105]})
    assert "spread 11%" in over["vs_fp32_noisy"]


@pytest.mark.parametrize("reps", [1, 2])
def test_fewer_than_three_repetitions_cannot_judge_the_spread(reps):
    _, row = bench_rows({"fp32": [100] * reps, "bf16": [200] * reps})
    assert row["vs_fp32"] == 2 and row["vs_fp32_range"] == [2, 2]
    said = "1 repetition" if reps == 1 else f"{reps} repetitions"
    assert row["vs_fp32_noisy"] == f"{said}: too few to judge the spread (at least 3)"


def test_the_base_row_is_1_by_definition_and_tf32_rows_get_their_own_ratios():
    rows = bench_rows({"fp32": [100, 80, 120], "tf32": [300, 240, 360], "bf16": [600, 480, 720]})
    fp32, tf32, bf16 = rows
    assert (fp32["vs_fp32"], fp32["vs_fp32_noisy"]) == (1.0, None)
    assert (tf32["vs_tf32"], tf32["vs_tf32_noisy"]) == (1.0, None)
    assert fp32["vs_tf32"] == pytest.approx(1 / 3) and bf16["vs_tf32"] == pytest.approx(2)
    assert bf16["vs_fp32_range"] == pytest.approx([6, 6])
    has_tf32 = True
    assert bench._cells(fp32, has_tf32)[2] == "1.00×"
    assert bench._cells(bf16, has_tf32)[2:4] == ["6.00× (6.00–6.00)", "2.00× (2.00–2.00)"]


def test_repetitions_rotate_the_order_of_the_precisions(monkeypatch):
    calls = []

    def fake_measure(cfg, warmup, steps):
        calls.append(cfg)
        if cfg == "broken":
            raise ConfigError("refused")
        return fake_rep(100.0)

    monkeypatch.setattr(bench, "measure", fake_measure)
    configs = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
    measured, refused = bench.measure_reps(configs, warmup=1, steps=1, reps=3)

    assert calls == ["fp32", "bf16", "fp16", "bf16", "fp16", "fp32", "fp16", "fp32", "bf16"]
    assert {name: len(reps) for name, reps in measured.items()} == {"fp32": 3, "bf16": 3, "fp16": 3}
    assert refused == {}

    calls.clear()
    measured, refused = bench.measure_reps({"fp32": "fp32", "x": "broken"}, 1, 1, reps=2)
    assert calls == ["fp32", "broken", "fp32"]  # a refused config is not tried again
    assert refused == {"x": "refused"} and list(measured) == ["fp32"]


@pytest.mark.slow
def test_bench_command_writes_to_hydra_run_dir_as_hydra_parses_it(tmp_path):
    # Hydra's own parsing: quotes are removed and ${now:...} is resolved.
    result = run_mptrain(
        tmp_path,
        "bench",
        "model=mlp",
        "model.hidden_sizes=[16]",
        "device=cpu",
        "bench.warmup_steps=1",
        "bench.steps=2",
        "bench.reps=3",
        "hydra.run.dir='my runs/bench_${now:%Y}'",
    )

    assert result.returncode == 0, describe(result)
    (written,) = (tmp_path / "my runs").glob("bench_20*/bench.json")
    rows = json.loads(written.read_text())["rows"]
    assert rows[0]["precision"] == "fp32" and rows[0]["samples_per_s"] > 0
    measured = [r for r in rows if "skipped" not in r]
    assert [len(r["reps"]) for r in measured] == [3] * len(measured)
    # The printed table: ranges, the noisy mark where a ratio has it, and why.
    for row in measured[1:]:
        low, high = row["vs_fp32_range"]
        cell = f"{row['vs_fp32']:.2f}× ({low:.2f}–{high:.2f})"
        assert cell + (" noisy" if row["vs_fp32_noisy"] else "") in result.stdout, result.stdout
        if row["vs_fp32_noisy"]:
            assert f"vs fp32 noisy: {row['vs_fp32_noisy']}" in " ".join(result.stdout.split())
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["foo=1"], "foo: unknown key"),
        (["bench.steps=0"], "bench.steps=0"),
        (["bench.reps=0"], "bench.reps=0"),
        (["-m", "model=mlp"], "-m:"),
        (["hydra.job.chdir=true"], "hydra.job.chdir=true:"),
        (["hydra.run.dir="], "hydra.run.dir=: empty"),
    ],
)
def test_bench_command_refuses_bad_input_in_one_line(tmp_path, monkeypatch, args, named):
    result = run_cli(["bench", *args], tmp_path, monkeypatch)  # cli.main, in this process

    assert result.code == 2, result
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("mptrain: error:"), result
    assert named in errors[0]
    assert not (tmp_path / "outputs").exists()


BOX = set("┏┓┗┛┃━│─┡┩╇┳┻┼└┘┌┐")


def test_a_log_file_gets_the_table_as_plain_text_and_a_terminal_keeps_rich():
    result = {"model": "mlp", "dataset": "digits", "reps": 1, "tokens_per_sample": None,
              "rows": bench_rows({"fp32": [100], "bf16": [200]})}  # fmt: skip
    piped = io.StringIO()  # `mptrain bench > bench.log`
    bench._print(Console(file=piped, width=160), result)
    text = piped.getvalue()
    assert not BOX & set(text), text
    title, header, *rows = text.splitlines()[:4]
    assert title == "mptrain bench: mlp on digits"
    assert header.split("  ")[0] == "precision" and header.index("vs fp32") == rows[0].index(
        "1.00×"
    )
    assert "Medians of 1 repetition (" in text
    terminal = io.StringIO()
    bench._print(Console(file=terminal, width=160, force_terminal=True), result)
    assert BOX & set(terminal.getvalue())
