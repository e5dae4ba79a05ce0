"""``mptrain bench``: which precisions are timed where, the figures and ratios it reports, the files
it writes, and its command line (CPU-only; the CUDA rows are checked with the device facts faked).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import describe, run_mptrain, tiny_run
from rich.console import Console

from mptrain import bench, hardware
from mptrain.config import PrecisionConfig

CPU = torch.device("cpu")


def skipped(rows: list[tuple[str, str | None]]) -> dict[str, str | None]:
    return dict(rows)


def test_cpu_precisions_skip_what_would_not_be_a_speed(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    conv = skipped(bench.bench_precisions(CPU, model_has_convs=True))
    linear = skipped(bench.bench_precisions(CPU, model_has_convs=False))

    assert list(conv) == ["fp32", "bf16", "fp16", "fp8"]  # no TF32 on a CPU
    assert conv["fp32"] is None and conv["bf16"] is None
    assert "FP16 convolutions" in conv["fp16"]
    assert linear["fp16"] is None  # Linear-only models time FP16 on the CPU
    assert "emulated" in conv["fp8"]

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert "no native BF16" in skipped(bench.bench_precisions(CPU, False))["bf16"]


@pytest.mark.parametrize(("native_bf16", "fp8_gemm"), [(True, True), (False, False)])
def test_cuda_precisions_include_tf32_and_what_the_gpu_has(monkeypatch, native_bf16, fp8_gemm):
    monkeypatch.setattr(hardware, "cuda_has_native_bf16", lambda device: native_bf16)
    monkeypatch.setattr(bench, "fp8_gemm_available", lambda device: fp8_gemm)
    rows = skipped(bench.bench_precisions(torch.device("cuda"), model_has_convs=True))

    assert list(rows) == ["fp32", "tf32", "fp16", "bf16", "fp8"]
    assert rows["fp32"] is None and rows["tf32"] is None and rows["fp16"] is None
    assert (rows["bf16"] is None) == native_bf16
    assert (rows["fp8"] is None) == fp8_gemm


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

    rows = bench.run_bench(cfg, tmp_path / "bench", warmup=2, steps=3, console=console)

    by_name = {r["precision"]: r for r in rows}
    assert list(by_name) == ["fp32", "bf16", "fp16", "fp8"]
    assert "skipped" in by_name["fp8"]
    measured = [by_name[name] for name in ("fp32", "bf16", "fp16")]
    for row in measured:
        assert row["samples_per_s"] > 0 and row["step_time_ms"] > 0, row
        assert 0 <= row["data_wait_fraction"] < 1, row
        # samples/s and step time come from the same stopwatch: batch / step time.
        expected = cfg.batch_size / (row["step_time_ms"] / 1000)
        assert math.isclose(row["samples_per_s"], expected, rel_tol=1e-9), row
        assert math.isclose(row["vs_fp32"], row["samples_per_s"] / by_name["fp32"]["samples_per_s"])
    assert by_name["fp32"]["vs_fp32"] == 1.0
    # FP16: the scaler's inf check, the new scale, the loss's finiteness (see mptrain.loop)
    assert [r["host_syncs_per_step"] for r in measured] == [0, 0, 1]
    assert by_name["fp16"]["label"] and by_name["bf16"]["label"]

    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert written["rows"] == rows
    assert (written["warmup_steps"], written["measured_steps"]) == (2, 3)
    table = (tmp_path / "bench" / "bench.md").read_text()
    assert table.count("\n| ") == 1 + len(rows)  # header and one line per precision
    assert "skipped: no FP8 hardware" in table
    assert "vs fp32" in console.export_text()


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
        "hydra.run.dir='my runs/bench_${now:%Y}'",
    )

    assert result.returncode == 0, describe(result)
    (written,) = (tmp_path / "my runs").glob("bench_20*/bench.json")
    rows = json.loads(written.read_text())["rows"]
    assert rows[0]["precision"] == "fp32" and rows[0]["samples_per_s"] > 0
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["foo=1"], "foo: unknown key"),
        (["bench.steps=0"], "bench.steps=0"),
        (["-m", "model=mlp"], "-m:"),
        (["hydra.job.chdir=true"], "hydra.job.chdir=true:"),
        (["hydra.run.dir="], "hydra.run.dir=: empty"),
    ],
)
def test_bench_command_refuses_bad_input_in_one_line(tmp_path, args, named):
    result = run_mptrain(tmp_path, "bench", *args)

    assert result.returncode == 2, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("mptrain: error:"), describe(result)
    assert named in errors[0]
    assert not (tmp_path / "outputs").exists()
