"""The scripts in benchmarks/ run end to end on a CPU in seconds (smoke runs: figures are not
checked, only that each script works and writes what BENCHMARKS.md reads). The GPU scripts run their
``--device cpu`` mode, so they are known to work before any GPU time is spent on them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command

from benchmarks import gpu_all, gpu_runs, gpu_setup, gpu_summary

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
TIMEOUT_S = 300


def run_script(
    name: str, *args: str, cwd: Path, timeout: float = TIMEOUT_S, first_on_path: str | None = None
):
    """``python -m benchmarks.NAME args`` in ``cwd``, the repository root on PYTHONPATH (after
    ``first_on_path``), as a user runs it from the root."""
    path = os.pathsep.join(filter(None, [first_on_path, str(REPO)]))
    module = f"benchmarks.{name.removesuffix('.py')}"
    return run_command(
        cwd, sys.executable, "-m", module, *args, timeout=timeout, env={"PYTHONPATH": path}
    )


def run_to_json(name: str, *args: str, cwd: Path) -> dict:
    """Run a benchmark script with ``--out``; the JSON document it wrote."""
    out = cwd / "result.json"
    result = run_script(name, *args, "--out", str(out), cwd=cwd)
    assert result.returncode == 0, describe(result)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_overhead_benchmark_pairs_every_variant_with_the_bare_loop(tmp_path):
    doc = run_to_json(
        "overhead.py", "--models", "linear", "--steps", "3", "--warmup", "2", "--reps", "2",
        cwd=tmp_path,
    )  # fmt: skip

    cases = [(r["model"], r["dataset"], r["precision"]) for r in doc["rows"]]
    assert cases == [
        ("linear", dataset, precision)
        for dataset in ("digits", "synthetic")
        for precision in ("fp32", "bf16")
    ]
    peers = {name for name in ("lightning", "accelerate") if importlib.util.find_spec(name)}
    for row in doc["rows"]:
        variants = set(row["reps_step_s"])
        assert variants == {"mptrain", "bare", "bare+DataLoader"} | peers
        assert set(row["ratio_to_mptrain"]) == peers
        assert all(len(times) == 2 and min(times) > 0 for times in row["reps_step_s"].values())
        assert set(row["ratio_to_bare"]) == variants - {"bare"}
        paired = row["ratio_to_bare"]["mptrain"]
        ratios = [
            m / b
            for m, b in zip(row["reps_step_s"]["mptrain"], row["reps_step_s"]["bare"], strict=True)
        ]
        assert math.isclose(paired["median"], sum(ratios) / 2)  # median of two
        assert set(row["added_s_per_step"]) == variants - {"bare"}
    assert doc["hardware"]["device"] == "cpu" and doc["versions"]["torch"]


@pytest.mark.slow
def test_resnet50_script_smoke_run_on_cpu(tmp_path):
    doc = run_to_json(
        "gpu_resnet50.py", "--device", "cpu", "--batch", "2", "--image-size", "32",
        "--steps", "1", "--warmup", "1", "--precisions", "fp32,bf16", cwd=tmp_path,
    )  # fmt: skip

    # Each precision as mptrain trains (cudnn.benchmark off), then BF16 autotuned (the default
    # --autotuned), as the DeepLearningExamples reference runs.
    rows = [(r["precision"], r["cudnn_benchmark"]) for r in doc["rows"]]
    assert rows == [("fp32", False), ("bf16", False), ("bf16", True)]
    assert all(r["samples_per_s"] > 0 and "error" not in r for r in doc["rows"])
    assert doc["rows"][0]["vs_fp32"] == 1.0
    assert "vs_tf32" not in doc["rows"][0]  # no TF32 row to compare with
    assert "32 px, batch 2" in doc["benchmark"] and "cudnn.benchmark on" in doc["reference"]


@pytest.mark.slow
def test_fp8_script_smoke_run_on_cpu(tmp_path):
    doc = run_to_json(
        "gpu_fp8_check.py", "--device", "cpu", "--gemm-shapes", "64x128x256", "--steps", "4",
        "--warmup", "2", "--batch", "64", "--width", "64",
        "--variants", "bf16,fp8,fp8_rowwise,fp8_rowwise_compiled", "--compile-backend", "aot_eager",
        "--speed-shapes", "64x128x256", "--speed-repeats", "2", cwd=tmp_path,
    )  # fmt: skip

    assert "not FP8 hardware" in doc["note"]
    gemms = doc["gemm_agreement"]
    assert [(g["granularity"], g["a_dtype"]) for g in gemms] == [
        ("tensorwise", "float8_e4m3fn"),
        ("tensorwise", "float8_e5m2"),
        ("rowwise", "float8_e4m3fn"),
        ("rowwise", "float8_e5m2"),
    ]
    # torch._scaled_mm and the emulation multiply the same FP8 operands: they agree far beyond
    # what FP8 itself keeps of the FP32 product.
    assert all(g["real_vs_emulated_sqnr_db"] > 60 for g in gemms)
    assert all(10 < g["real_vs_fp32_sqnr_db"] < 40 for g in gemms)
    training = doc["training"]
    assert training["all_losses_finite"] and training["failed"] == {}
    variants = training["variants"]
    assert list(variants) == ["bf16", "fp8", "fp8_rowwise", "fp8_rowwise_compiled"]
    for name in ("fp8", "fp8_rowwise"):  # first and last layers stay in BF16
        assert 0 < variants[name]["converted_flops_share"] < 1
    # Each FP8 variant against BF16 of its mode; no compiled BF16 ran: no row for compiled FP8.
    assert {n: r["vs"] for n, r in training["vs_bf16"].items()} == {
        "fp8": "bf16",
        "fp8_rowwise": "bf16",
    }
    # Compiled variants say how many graph breaks torch._dynamo counted (none in this MLP);
    # eager ones have nothing to count.
    compiled = variants["fp8_rowwise_compiled"]
    assert compiled["graph_breaks"] == 0 and compiled["graphs"] >= 1
    assert "graph_breaks" not in variants["fp8"]
    assert training["use_fast_accum"] is False and "use_fast_accum=True" in doc["accumulation"]
    speeds = doc["forward_gemm"]
    assert [(g["shape"], g["granularity"]) for g in speeds] == [
        ([64, 128, 256], "tensorwise"),
        ([64, 128, 256], "rowwise"),
    ]
    for row in speeds:
        assert set(row["tflops"]) == {"bf16", "fp8", "fp8_fast_accum"}, row
        assert row["fast_accum_vs_emulated_sqnr_db"] > 60  # same FP8 operands: BF16 rounding


def load_script(name: str):
    """A benchmark script as the module ``benchmarks.NAME`` (its functions, without running
    main): imported when a test needs it, since most import torch and mptrain."""
    return importlib.import_module(f"benchmarks.{name.removesuffix('.py')}")


@pytest.mark.slow
def test_gpt_script_smoke_run_on_cpu(tmp_path):
    doc = run_to_json(
        "gpu_gpt.py", "--device", "cpu", "--precisions", "fp32,bf16,fp8", cwd=tmp_path
    )

    rows = {r["precision"]: r for r in doc["rows"]}
    assert list(rows) == ["fp32", "bf16", "fp8"]
    block = doc["settings"]["block"]
    assert block == 64 and "width 64, 1 layers" in doc["benchmark"]  # the CPU smoke sizes
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["step_time_ms"] > 0, row
        assert math.isclose(row["tokens_per_s"], row["samples_per_s"] * block, rel_tol=1e-12)
        assert "peak_memory_bytes" in row and "vs_tf32" not in row  # no TF32 row asked for
        # A CPU has no peak in the table: MFU fields present, null, with the reason.
        assert row["mfu"] is None and row["mfu_vs_bf16_peak"] is None, row
    assert rows["fp32"]["vs_fp32"] == 1.0
    assert rows["bf16"]["vs_fp32"] == rows["bf16"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"]
    assert "no peak FLOP/s known for a CPU" in rows["fp32"]["mfu_note"]
    assert doc["prediction"] == {"gpu": None, "note": "no prediction: on a CPU"}
    assert not rows["fp32"]["emulated"] and rows["fp8"]["emulated"]
    assert "emulated FP8" in rows["fp8"]["mfu_note"] and "emulated" in rows["fp8"]["label"]
    assert doc["mfu"]["tflops"] == {} and "a CPU" in doc["mfu"]["unknown_reason"]
    assert set(doc["mfu"]["basis"]) == {"mfu", "mfu_vs_bf16_peak"}
    flops = doc["flops"]
    assert flops["per_token"] == 6 * flops["parameters_counted"] + 12 * 1 * block * 64


def test_gpt_flops_count_and_mfu_against_the_peak_table():
    gpt = load_script("gpu_gpt.py")
    shape = gpt.GPTShape(vocab_size=256, block_size=1024, layers=4, heads=16, width=2048)
    w, layers = 2048, 4
    # Per block: qkv, attention out, MLP in and out (weights and biases) and two LayerNorms;
    # then the final LayerNorm and the token embedding (tied to the head, counted once).
    n = layers * (12 * w * w + 13 * w) + 2 * w + 256 * w
    assert gpt.parameters_counted(shape) == n
    assert gpt.flops_per_token(shape) == 6 * n + 12 * layers * 1024 * w

    # The peaks are mptrain.perf.gpus' (dense: datasheets' with-sparsity figures halved).
    assert gpt.table_peaks("NVIDIA H200")[1]["fp8"] == 1979
    assert gpt.table_peaks("NVIDIA H100 80GB HBM3")[1]["bf16"] == 989.5
    assert gpt.table_peaks("NVIDIA H100 PCIe") == ("h100-pcie", gpt.gpus.GPUS["h100-pcie"].tflops)
    assert gpt.table_peaks("NVIDIA A100-SXM4-80GB")[1] == {
        "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312,
    }  # fmt: skip
    for other in ("NVIDIA GeForce RTX 3090", "Tesla V100-SXM2-16GB", None):
        assert gpt.table_peaks(other) == (None, {}), other

    peaks = gpt.peak_table("NVIDIA H200", {})
    row = {"precision": "bf16", "tokens_per_s": 1e6, "emulated": False}
    gpt.add_mfu(row, 10**9, peaks)  # 1e15 FLOP/s
    assert row["mfu"] == pytest.approx(1e15 / 989.5e12) == row["mfu_vs_bf16_peak"]
    fp8 = {"precision": "fp8", "tokens_per_s": 1e6, "emulated": False}
    gpt.add_mfu(fp8, 10**9, peaks)
    assert fp8["mfu"] == pytest.approx(1e15 / 1979e12) and fp8["mfu_note"] is None
    # FP8 and BF16 GEMMs mixed, half the FLOPs each: the FLOP-weighted peak 2 / (1/1979 + 1/989.5).
    gpt.add_mfu(fp8, 10**9, peaks, {"fp8": 1.0, "bf16": 1.0})
    assert fp8["mfu"] == pytest.approx(1e15 / (2 / (1 / 1979e12 + 1 / 989.5e12)))
    emulated = {"precision": "fp8", "tokens_per_s": 1e6, "emulated": True}
    gpt.add_mfu(emulated, 10**9, gpt.peak_table("NVIDIA A100-SXM4-80GB", {}))
    assert emulated["mfu"] is None and "emulated FP8" in emulated["mfu_note"]
    # --peak-tflops adds to (or replaces) the table; a GPU it lacks then gets an MFU too.
    override = gpt.peak_table("NVIDIA GeForce RTX 3090", gpt.parse_peaks("fp32=30"))
    assert override["source"] == "--peak-tflops" and override["unknown_reason"] is None
    fp32 = {"precision": "fp32", "tokens_per_s": 1e6, "emulated": False}
    gpt.add_mfu(fp32, 3 * 10**7, override)
    assert fp32["mfu"] == pytest.approx(1.0) and fp32["mfu_vs_bf16_peak"] is None
    assert fp32["mfu_note"] == "no bf16 peak for this GPU"
    with pytest.raises(ValueError, match="PRECISION=TFLOPS"):
        gpt.parse_peaks("int8=10")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_scripts_need_a_gpu_or_say_so(tmp_path):
    for name in ("gpu_resnet50.py", "gpu_fp8_check.py", "gpu_gpt.py"):
        result = run_script(name, cwd=tmp_path, timeout=60)
        assert result.returncode == 2, name
        assert "--device cpu" in result.stderr, name


# ------------------------------------------------------------- a row that raises loses only itself
def run_main(module, monkeypatch, *argv: str) -> int:
    """A script's main() in this process, with ``argv`` as its command line."""
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def rows_on_disk(out: Path, key: str = "rows") -> list:
    return json.loads(out.read_text())[key] if out.exists() else None


@pytest.mark.slow
def test_gpt_row_that_raises_is_recorded_and_the_other_rows_kept(tmp_path, monkeypatch):
    """Any exception, not only out of memory: an FP8 kernel's RuntimeError must not cost the
    rows measured before and after it. The document is on disk after every row."""
    gpt = load_script("gpu_gpt.py")
    out, real, seen = tmp_path / "gpt.json", gpt.measure, []

    def measure(cfg, warmup, steps):
        seen.append([r["precision"] for r in rows_on_disk(out) or []])
        if cfg.precision.name == "bf16":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return real(cfg, warmup, steps)

    monkeypatch.setattr(gpt, "measure", measure)
    code = run_main(gpt, monkeypatch, "--device", "cpu", "--precisions", "fp32,bf16,fp8",
                    "--out", str(out))  # fmt: skip

    assert code == 1 and seen == [[], ["fp32"], ["fp32", "bf16"]]
    rows = {r["precision"]: r for r in rows_on_disk(out)}
    assert list(rows) == ["fp32", "bf16", "fp8"]
    error = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rows["bf16"]["error"] == error and rows["bf16"]["mfu_note"] == "not measured"
    assert rows["fp8"]["tokens_per_s"] > 0 and rows["fp8"]["vs_fp32"] > 0


@pytest.mark.slow
def test_resnet50_precision_that_raises_is_recorded_and_the_others_kept(tmp_path, monkeypatch):
    resnet = load_script("gpu_resnet50.py")
    out, real = tmp_path / "rn50.json", resnet.measure

    def measure(cfg, warmup, steps):
        if cfg.precision.name == "bf16" and not torch.backends.cudnn.benchmark:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, warmup, steps)

    monkeypatch.setattr(resnet, "measure", measure)
    code = run_main(
        resnet, monkeypatch, "--device", "cpu", "--batch", "2", "--image-size", "32", "--steps",
        "1", "--warmup", "1", "--precisions", "fp32,bf16", "--out", str(out),
    )  # fmt: skip

    assert code == 1
    fp32, bf16, autotuned = rows_on_disk(out)
    assert bf16["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert fp32["vs_fp32"] == 1.0 and autotuned["cudnn_benchmark"] and autotuned["vs_fp32"] > 0
    assert torch.backends.cudnn.benchmark is False  # the autotuned row turned it off again


@pytest.mark.slow
def test_imagefolder_keeps_the_cpu_row_when_the_cuda_pipeline_fails(tmp_path, monkeypatch):
    folder = load_script("imagefolder_train.py")
    real = folder.train_once

    def train_once(args, root, pipeline, run_dir):
        if pipeline == "cuda":
            raise RuntimeError("the cuda pipeline's run failed (exit 1; output above)")
        return real(args, root, pipeline, run_dir)

    monkeypatch.setattr(folder, "train_once", train_once)
    out = tmp_path / "folder.json"
    code = run_main(
        folder, monkeypatch, "--device", "cpu", "--images", "8", "--image-size", "32",
        "--batch", "4", "--steps", "1", "--warmup", "1", "--workers", "0", "--jobs", "1",
        "--precision", "fp32", "--model", "cnn", "--out", str(out),
    )  # fmt: skip

    assert code == 1
    pipelines = rows_on_disk(out, "pipelines")
    assert pipelines["cpu"]["images_per_s"] > 0 and pipelines["cpu"]["host_decoded"] is None
    assert pipelines["cuda (on cpu)"] == {"error": "RuntimeError: the cuda pipeline's run failed "
                                                   "(exit 1; output above)"}  # fmt: skip


def test_fp8_check_gemm_and_variant_that_raise_are_recorded(tmp_path, monkeypatch):
    """The GEMM check sits inside its own per-row try: one GEMM that raises costs the verdict
    (FAIL, with the reason) but not the other GEMMs or the training."""
    fp8 = load_script("gpu_fp8_check.py")
    real_gemm, real_train = fp8.gemm_row, fp8.train_throughput

    def gemm_row(device, shape, granularity, a_dtype):
        if granularity == "rowwise" and a_dtype == fp8.E5M2:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise")
        return real_gemm(device, shape, granularity, a_dtype)

    def train_throughput(device, name, sizes, backend):
        if name == "fp8_rowwise":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return real_train(device, name, sizes, backend)

    monkeypatch.setattr(fp8, "gemm_row", gemm_row)
    monkeypatch.setattr(fp8, "train_throughput", train_throughput)
    out = tmp_path / "fp8.json"
    code = run_main(
        fp8, monkeypatch, "--device", "cpu", "--gemm-shapes", "64x128x256", "--steps", "3",
        "--warmup", "1", "--batch", "32", "--width", "64", "--variants", "bf16,fp8,fp8_rowwise",
        "--speed-shapes", "64x128x256", "--speed-repeats", "1", "--out", str(out),
    )  # fmt: skip

    assert code == 0
    doc = json.loads(out.read_text())
    errors = [g.get("error") for g in doc["gemm_agreement"]]
    assert errors[:3] == [None, None, None] and errors[3].startswith("RuntimeError: Only bf16")
    training = doc["training"]
    assert list(training["variants"]) == ["bf16", "fp8"] and list(training["failed"]) == [
        "fp8_rowwise"
    ]
    verdict, reading = gpu_summary.fp8_verdict(doc)
    assert verdict == "FAIL" and "1 GEMMs raised" in reading


def test_data_path_pipeline_that_raises_is_recorded_and_not_rerun(tmp_path, monkeypatch):
    data_path = load_script("data_path.py")
    real, calls = data_path.new_epochs, []

    def new_epochs(cfg, layout, epochs):
        calls.append(cfg.decode_device)
        if cfg.decode_device == "cuda":
            raise RuntimeError("nvjpeg: NVJPEG_STATUS_EXECUTION_FAILED")
        return real(cfg, layout, epochs)

    monkeypatch.setattr(data_path, "new_epochs", new_epochs)
    # The script lifts mptrain.data's decode_device check on a CPU: put it back afterwards.
    monkeypatch.setattr(
        data_path.folder, "_check_decode_device", data_path.folder._check_decode_device
    )
    out = tmp_path / "dp.json"
    code = run_main(
        data_path, monkeypatch, "--workers", "0", "--images", "8", "--image-size", "32",
        "--reps", "2", "--epochs", "1", "--batch-size", "4", "--device-decode", "--json", str(out),
    )  # fmt: skip

    assert code == 1 and calls.count("cuda") == 1  # the failed pipeline is not run again
    doc = json.loads(out.read_text())
    assert set(doc["pipelines"]) == {"old", "new", "new, draft off"}
    assert all(len(row["reps"]) == 2 for row in doc["pipelines"].values())
    assert doc["errors"] == {
        "device-decode (cpu)": "RuntimeError: nvjpeg: NVJPEG_STATUS_EXECUTION_FAILED"
    }


# ------------------------------------------------------------------------ benchmarks/gpu_all.py
GPU_ALL_STEPS = [
    "setup", "nvidia_smi", "fp8_check", "speed_table", "pytest_gpu", "imagefolder_train",
    "collect_env", "resnet50", "gpt", "data_path",
]  # fmt: skip


@pytest.mark.slow
def test_gpu_all_smoke_run_runs_every_step_and_summarises(tmp_path):
    """As on the GPU machine's image (benchmarks/gpu_image: no torchao, nothing of the test extra):
    every script gpu_all runs imports only what the image has and the wheels it carries."""
    out = tmp_path / "gpu"
    image = str(BENCHMARKS / "gpu_image")
    result = run_script(
        "gpu_all", "--smoke", "--bundle", "--out", str(out), cwd=tmp_path, first_on_path=image
    )

    assert result.returncode == 0, describe(result)
    doc = json.loads((out / "summary.json").read_text())
    steps = {step["name"]: step for step in doc["steps"]}
    assert list(steps) == GPU_ALL_STEPS and doc["smoke"]
    for name, step in steps.items():
        if name == "nvidia_smi" and step["status"].startswith("not run"):
            continue  # no nvidia-smi on this machine
        assert step["status"] == "ok" and step["exit_code"] == 0, (name, step)
        assert not step["partial"], name
        assert f"[gpu_all] {name}: ok, exit 0" in result.stdout
    assert steps["resnet50"]["result"]["rows"][1]["precision"] == "bf16"
    assert [r["precision"] for r in steps["gpt"]["result"]["rows"]] == ["fp32", "fp8"]
    assert set(steps["imagefolder_train"]["result"]["pipelines"]) == {"cpu", "cuda (on cpu)"}
    # Every GPU test by name, with its outcome (here all skip: no CUDA).
    tests = steps["pytest_gpu"]["tests"]
    names = {t["test"] for t in tests}
    assert "tests/e2e/test_gpu.py::test_host_syncs_per_step_on_cuda[fp16-1]" in names
    assert len(tests) > 10 and {t["outcome"] for t in tests} == {"skipped"}
    summary = (out / "summary.md").read_text()
    assert "every step that ran succeeded" in summary
    assert "FP8 check: **PASS**" in summary and "use_fast_accum: false" in summary
    assert "fp8_rowwise_compiled: 0 graph breaks" in summary
    assert "| cuda (on cpu) |" in summary and "| bf16 + cudnn.benchmark |" in summary
    assert "| precision | tokens/s | vs fp32 | MFU | peak memory |" in summary
    assert "| fp8 (emulated) |" in summary and "emulated FP8: none" in summary
    assert f"- pytest_gpu: 0 passed, 0 failed, 0 error, {len(tests)} skipped" in summary
    assert "- `tests/e2e/test_gpu.py::test_channels_last_and_compile`: skipped" in summary
    # The speed table's markdown comes back beside the summaries, unbundled, as the JSON wrote it.
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_all_files.tar.gz", "speed_table.md", "summary.json", "summary.md",
    ]  # fmt: skip
    with tarfile.open(out / "gpu_all_files.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"setup.log", "fp8_check.json", "imagefolder_train.log", "pytest_gpu.xml"} <= members
    assert {"speed_table.json", "speed_table.log"} <= members
    check_speed_table_smoke(steps["speed_table"]["result"], (out / "speed_table.md").read_text())
    assert "### Speed table (speed_table.md)" in summary and SPEED_HEADER in summary
    pytest_log = tar_text(out / "gpu_all_files.tar.gz", "pytest_gpu.log")
    assert " -v " in pytest_log.splitlines()[0]  # every test's name in the log, come what may


SPEED_HEADER = (
    "| model | precision | compile | samples/s | tokens/s | vs fp32 eager | vs eager | step ms | "
    "peak memory | skipped steps (window/all) | compile s | MFU | predicted samples/s | note |"
)


def check_speed_table_smoke(doc: dict, markdown: str) -> None:
    """gpu_all --smoke's speed table (fp32 and FP8 rowwise, compile off, and on for the GPT, with
    aot_eager): every cell through mptrain's loop, stopped after its window with no evaluation;
    ResNet-50 refuses FP8 (no Linear to convert)."""
    cells = {(c["model"], c["precision"], c["compile"]): c for c in doc["cells"]}
    assert list(cells) == [
        ("gpt", "fp32", False), ("gpt", "fp8_rowwise", False),
        ("resnet50", "fp32", False), ("resnet50", "fp8_rowwise", False),
        ("gpt", "fp8_rowwise", True), ("gpt", "fp32", True),
    ]  # fmt: skip
    assert doc["compile_backend"] == "aot_eager" and doc["not_run_for_budget"] == []
    block, warmup = doc["sizes"]["gpt"]["block"], doc["sizes"]["gpt"]["warmup"]
    for key, cell in cells.items():
        f = cell["figures"]
        if key[0] == "resnet50" and key[1] == "fp8_rowwise":
            assert cell["status"] == "refused" and "no Linear layer" in cell["why"], cell
            continue
        assert cell["status"] == "ok", cell
        assert f["samples_per_s"] > 0 and f["measured_steps"] == f["planned_steps"], cell
        assert f["evaluations"] == 0 and f["skipped_in_window"] <= f["skipped_steps"]
        assert ("compile_s" in f) == key[2] and f["emulated"] == (key[1] == "fp8_rowwise")
        if key[2]:
            assert f["graphs"] >= 1 and f["graph_breaks"] == 0, cell
            same = cells[key[0], key[1], False]["figures"]["samples_per_s"]
            assert f["vs_eager"] == f["samples_per_s"] / same
        if key[0] == "gpt":
            assert f["steps_done"] == warmup + doc["sizes"]["gpt"]["steps"]
            assert math.isclose(f["tokens_per_s"], f["samples_per_s"] * block, rel_tol=1e-12)
            assert f["mfu"] is None and f["mfu_note"], cell  # a CPU: no peak, or emulated FP8
    assert cells["gpt", "fp32", False]["figures"]["vs_fp32"] == 1.0
    assert doc["predictor"] == "mptrain.commands.advise.predict" and doc["machine_load"]["words"]
    predicted = [c["figures"].get("predicted_error", "") for c in cells.values() if c["figures"]]
    assert all("on a CPU: no prediction" in p for p in predicted if p), predicted  # the roofline's
    assert markdown == doc["markdown"] and SPEED_HEADER in markdown
    assert "- Not run for lack of budget: none" in markdown
    assert "| gpt | fp8_rowwise (emulated) | on |" in markdown
    assert (
        "| resnet50 | fp8_rowwise | off | - |" in markdown and "refused: precision=fp8" in markdown
    )
    assert len([line for line in markdown.splitlines() if line.startswith("| ")]) == 2 + 6


def tar_text(path: Path, member: str) -> str:
    with tarfile.open(path) as tar:
        return tar.extractfile(member).read().decode()


def test_gpu_all_plan_fits_the_budget_and_the_device_call():
    """The planned steps' limits, setup's included, add up to the budget; their estimates fit
    in it with the optional steps; the budget leaves time of the device call for the summary."""
    steps = gpu_runs.plan("python3", Path("/out"), smoke=False, test_timeout_s=90)
    planned = [s for s in steps if not s.optional]
    assert gpu_runs.SETUP_S + sum(s.timeout_s for s in planned) == gpu_runs.BUDGET_S
    estimates = gpu_runs.SETUP_ESTIMATE_S + sum(s.estimate_s for s in planned)
    assert estimates <= gpu_runs.BUDGET_S < gpu_runs.DEVICE_TIMEOUT_S - 20
    assert gpu_runs.DEVICE_TIMEOUT_S <= 600  # the device tool's most per command
    # The FP8 verdict, the speed table, then the GPU tests (after the one-second nvidia-smi);
    # the rest only on time those left.
    names = [s.name for s in steps]
    assert names[:4] == ["nvidia_smi", "fp8_check", "speed_table", "pytest_gpu"]
    assert [s.name for s in planned] == names[:4]
    assert all(s.timeout_s >= s.estimate_s > s.start_s() for s in steps)
    by_name = {s.name: s for s in steps}
    pytest_argv = " ".join(by_name["pytest_gpu"].argv)
    assert (
        "pytest -v -p no:cacheprovider -o addopts=--strict-markers "
        "--continue-on-collection-errors -p timeout --timeout=90 "
    ) in pytest_argv
    without = gpu_runs.plan("python3", Path("/out"), smoke=False, test_timeout_s=None)[3].argv
    assert not any(arg.startswith("--timeout") for arg in without) and "timeout" not in without
    # The speed table stops its own cells SPEED_MARGIN_S before its limit; --speed-s moves both.
    speed = by_name["speed_table"]
    assert speed.timeout_s == gpu_runs.SPEED_S == 165
    assert speed.argv[-4:] == ["--budget-s", "145", "--out", "/out/speed_table.json"]
    longer = gpu_runs.plan("python3", Path("/out"), smoke=False, test_timeout_s=90, speed_s=470)
    assert longer[2].timeout_s == 470 and longer[2].argv[-3] == "450"


def test_gpu_all_reports_a_failed_and_a_hung_step_and_goes_on(tmp_path):
    python = sys.executable
    writes = f"import json; open({str(tmp_path / 'fails.json')!r}, 'w').write(json.dumps({{'rows': [1]}}))"
    steps = [
        gpu_runs.Step("fails", [python, "-c", f"{writes}; print('boom'); raise SystemExit(3)"], 30,
                     "exit 3", "fails.json", estimate_s=1),
        gpu_runs.Step("hangs", [python, "-c", "import time; time.sleep(60)"], 2, "sleeps",
                     estimate_s=1),
        gpu_runs.Step("late", [python, "-c", "pass"], 30, "no budget left", estimate_s=200),
        gpu_runs.Step("missing", ["no-such-command-here"], 30, "cannot start", "missing.json",
                     estimate_s=1),
    ]  # fmt: skip
    (tmp_path / "missing.json").write_text('{"stale": true}')  # an earlier run's, same --out
    budget = gpu_all.Budget(60)
    outcomes = [gpu_all.run_step(step, tmp_path, budget) for step in steps]

    assert [o.status for o in outcomes[:2]] == ["failed", "timed out"]
    assert outcomes[0].exit_code == 3
    # A failed step's document is read all the same, marked partial.
    assert outcomes[0].result == {"rows": [1]} and outcomes[0].partial
    assert outcomes[1].wall_s < 2.5  # SIGINT before its limit: it ended within it
    # 60 s left, half of the 200 s estimate needed to start: proportionate, not a flat 15 s.
    assert re.fullmatch(r"not run \(5\d s of the budget left, 100 s needed to start\)",
                        outcomes[2].status)  # fmt: skip
    assert outcomes[2].log is None
    assert outcomes[3].status.startswith("failed (cannot start")
    assert outcomes[3].result is None  # not the earlier run's document
    meta = {"date": "d", "smoke": True, "verdict": "SOME STEPS FAILED", "total_s": 2.0,
            "budget_s": 60.0, "python": python, "commit": "c"}  # fmt: skip
    summary = gpu_summary.summary_md(outcomes, tmp_path, meta)
    assert "| fails | exit 3 | failed, partial figures | 3 |" in summary
    assert "## fails: failed (last lines of fails.log)" in summary and "boom" in summary
    assert "## hangs: timed out" in summary and "stopped at its limit of 2 s" in summary
    assert "## late" not in summary  # not run: in the table only


SLOW_SCRIPT = """
import os, sys, time
from pathlib import Path
from benchmarks.jsondoc import write_json
out = Path(sys.argv[1])
Path(str(out) + ".pid").write_text(str(os.getpid()))
rows = []
for k in range(2):
    rows.append({{"row": k}})
    write_json(out, {{"rows": rows}})
time.sleep(120)
"""


@pytest.mark.slow
def test_gpu_all_keeps_what_a_step_over_its_limit_measured(tmp_path):
    code = SLOW_SCRIPT.format()
    step = gpu_runs.Step("slow", [sys.executable, "-c", code, str(tmp_path / "slow.json")], 4,
                        "two rows, then hangs", "slow.json", estimate_s=1)  # fmt: skip
    outcome = gpu_all.run_step(step, tmp_path, gpu_all.Budget(60))

    assert outcome.status == "timed out" and outcome.partial and outcome.wall_s < 4.5
    assert outcome.result == {"rows": [{"row": 0}, {"row": 1}]}
    meta = {"date": "d", "smoke": True, "verdict": "SOME STEPS FAILED", "total_s": 4.0,
            "budget_s": 60.0, "python": "p", "commit": "c"}  # fmt: skip
    assert "| slow | two rows, then hangs | timed out, partial figures |" in gpu_summary.summary_md(
        [outcome], tmp_path, meta
    )


@pytest.mark.slow
def test_gpu_all_pytest_over_its_limit_leaves_junit_and_every_test_named(tmp_path):
    """SIGINT first: pytest writes its JUnit XML; the test it interrupted is named from the
    ``-v`` log."""
    tests = tmp_path / "test_slow.py"
    tests.write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_hangs():\n    time.sleep(60)\n\ndef test_never_reached():\n    pass\n"
    )
    argv = gpu_runs.pytest_argv(sys.executable, tmp_path / "p.xml", [str(tests)], None)
    step = gpu_runs.Step("p", argv, 10, "pytest", estimate_s=1, junit="p.xml")
    outcome = gpu_all.run_step(step, tmp_path, gpu_all.Budget(60))

    assert outcome.status == "timed out" and (tmp_path / "p.xml").exists()
    outcomes = {gpu_summary.same_test(t["test"]): t["outcome"] for t in outcome.tests}
    assert outcomes == {
        "test_slow::test_quick": "passed",
        "test_slow::test_hangs": "running when stopped",
    }


def test_gpu_all_names_every_test_from_junit_xml(tmp_path):
    (tmp_path / "p.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="tests.e2e.test_gpu" name="test_a[fp16]" time="1.5"/>'
        '<testcase classname="tests.e2e.test_gpu" name="test_b" time="0.1">'
        '<failure message="AssertionError: 2 syncs&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.precision.test_fp8" name="test_c" time="0.0">'
        '<skipped type="pytest.skip" message="needs 2 GPUs">skip</skipped></testcase>'
        '<testcase classname="tests.precision.test_fp8" name="test_d" time="90.0">'
        '<failure message="Failed: Timeout >90.0s">t</failure><error message="teardown">e</error>'
        "</testcase></testsuite></testsuites>"
    )
    (tmp_path / "p.log").write_text("tests/e2e/test_gpu.py::test_a[fp16] PASSED  [ 25%]\n")

    tests = gpu_summary.step_tests(tmp_path / "p.xml", tmp_path / "p.log")
    assert [(t["test"], t["outcome"], t["message"]) for t in tests] == [
        ("tests/e2e/test_gpu.py::test_a[fp16]", "passed", ""),
        ("tests/e2e/test_gpu.py::test_b", "failed", "AssertionError: 2 syncs"),
        ("tests/precision/test_fp8.py::test_c", "skipped", "needs 2 GPUs"),
        ("tests/precision/test_fp8.py::test_d", "error", "teardown"),
    ]
    # No XML (a hard kill): the log alone names them.
    assert gpu_summary.step_tests(tmp_path / "none.xml", tmp_path / "p.log") == [
        {"test": "tests/e2e/test_gpu.py::test_a[fp16]", "outcome": "passed", "time_s": None,
         "message": ""},
    ]  # fmt: skip
    lines = gpu_summary.test_lines([gpu_summary.Outcome("pytest_gpu", "w", "ok", tests=tests)])
    assert "- `tests/e2e/test_gpu.py::test_b`: failed (0.1 s): AssertionError: 2 syncs" in lines


DRIVER = """
import sys, time
from benchmarks import gpu_all, gpu_runs, gpu_setup, gpu_summary

def setup(args, out, budget):
    return gpu_summary.Outcome("setup", gpu_setup.SETUP_WHAT, "ok", 0, 0.1, 45, None)

def plan(python, out, smoke, test_timeout_s, **settings):
    slow = [python, "-c", {slow!r}, str(out / "slow.json")]
    return [
        gpu_runs.Step("quick", [python, "-c", "print('quick')"], 30, "ends at once", estimate_s=1),
        gpu_runs.Step("slow", slow, 100, "two rows, then hangs", "slow.json", estimate_s=1),
        gpu_runs.Step("after", [python, "-c", "pass"], 30, "never reached", estimate_s=1),
    ]

gpu_all.setup, gpu_all.plan = setup, plan
raise SystemExit(gpu_all.main(sys.argv[1:]))
"""


def test_gpu_all_killed_driver_leaves_the_summary_and_the_partial_json(tmp_path):
    """SIGTERM to the driver (the device tool's time limit): the running step's process group
    is stopped, what it measured is read, the summary written and the files bundled."""
    import signal
    import subprocess
    import time

    slow = SLOW_SCRIPT.format()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(slow=slow))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(driver), "--out", str(out), "--budget-s", "200", "--bundle"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=gpu_runs.child_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (out / "slow.json").exists() or len(rows_on_disk(out / "slow.json")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        # Written after the first step, before the driver was stopped.
        early = json.loads((out / "summary.json").read_text())
        assert early["verdict"].startswith("RUNNING") and early["steps"][2]["status"] == (
            "not run yet"
        )
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    doc = json.loads((out / "summary.json").read_text())
    assert doc["verdict"] == "STOPPED (the driver got SIGTERM)"
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["quick"]["status"] == "ok"
    assert steps["slow"]["status"] == "stopped (the driver got SIGTERM)"
    assert steps["slow"]["partial"] and steps["slow"]["result"] == {
        "rows": [{"row": 0}, {"row": 1}]
    }
    assert steps["after"]["status"] == "not run yet"
    assert "STOPPED (the driver got SIGTERM)" in (out / "summary.md").read_text()
    pid = int(tar_text(out / "gpu_all_files.tar.gz", "slow.json.pid"))
    try:  # the step's process is gone, not left running on the device
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_gpu_all_without_wheels_fails_fast_with_the_two_commands(tmp_path, capsys):
    """No .whl carried, hydra missing: one line and the two commands, no pip retries."""
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'hydra'\" >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    args = gpu_all.parse_args(["--python", str(fake), "--out", str(tmp_path)])
    args.wheels = None  # as on a device where .whl/ was not carried

    outcome = gpu_all.setup(args, tmp_path, gpu_all.Budget(60))
    assert outcome.status.startswith("failed (the wheels were not carried: no module 'hydra'")
    assert outcome.wall_s < 10 and not (tmp_path / "install.log").exists()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("[gpu_all] setup: no module 'hydra', and the wheels were not")
    assert printed[1].strip() == "python3 -m benchmarks.gpu_all --fetch-wheels .whl"
    assert 'carry=[".whl"]' in printed[2] and "timeout_s=540" in printed[2]


def test_gpu_all_import_check_that_hangs_is_a_failed_setup(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(0o755)
    ok, said = gpu_setup.can_import(str(fake), smoke=True, timeout_s=1)
    assert not ok and said == "the import check timed out after 1 s"


def test_gpu_all_writes_to_out_bundled_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gpu_all.parse_args([])
    assert args.out == tmp_path and args.bundle and args.budget_s == gpu_runs.BUDGET_S
    monkeypatch.delenv("OUT")
    args = gpu_all.parse_args(["--smoke"])
    assert not args.bundle and args.out.parent.name == "results"
    assert "gpu_smoke_" in args.out.name


@pytest.mark.slow
def test_fp8_rowwise_sqnr_script_shows_rowwise_keeping_ordinary_rows(tmp_path):
    doc = run_to_json("fp8_rowwise_sqnr.py", "--outliers", "1,1e5", cwd=tmp_path)

    rows = {(r["outlier"], r["granularity"]): r["out_ordinary_rows"] for r in doc["rows"]}
    assert set(rows) == {(o, g) for o in (1.0, 1e5) for g in ("tensorwise", "rowwise")}
    # Without outliers the two agree; next to 1e5x rows only rowwise keeps the ordinary rows.
    assert abs(rows[1.0, "tensorwise"] - rows[1.0, "rowwise"]) < 0.5
    assert rows[1e5, "tensorwise"] < 10 < 28 < rows[1e5, "rowwise"]


# ------------------------------------------------------------------------ benchmarks/contention.py
@pytest.mark.slow
def test_contention_benchmark_pairs_auto_with_the_default_under_each_load(tmp_path):
    doc = run_to_json(
        "contention.py", "--busy", "0", "1", "--reps", "1", "--cnn-steps", "3", "--gpt-steps", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert [(r["job"], r["busy"]) for r in doc["rows"]] == [
        ("cnn", 0), ("gpt", 0), ("cnn", 1), ("gpt", 1),
    ]  # fmt: skip
    for row in doc["rows"]:
        assert set(row["runs"]) == {"auto", "default"}
        default = row["runs"]["default"][0]
        assert default["threads_used"] == doc["cpu_count"] and default["measurements"] == []
        assert row["auto_over_default"] > 0 and row["auto_over_fair_share"] > 0


# ------------------------------------------------------------------------ benchmarks/gpu_speed.py
FAKE_SECONDS = {
    ("gpt", False): 4,
    ("resnet50", False): 6,
    ("gpt", True): 30,
    ("resnet50", True): 40,
}


class FakeCells:
    """gpu_speed's ``train`` and ``clock`` for a Section: a cell takes FAKE_SECONDS of a fake clock
    (a cell whose deadline comes first stops there, in its warm-up: nothing timed); mptrain
    refuses FP8 on ResNet-50; ``interrupt`` raises KeyboardInterrupt at that cell."""

    def __init__(self, config_error: type, interrupt: str | None = None):
        self.now, self.ran, self.config_error, self.interrupt = 0.0, [], config_error, interrupt

    def clock(self) -> float:
        return self.now

    def train(self, cell, warmup: int, steps: int, deadline: float) -> dict:
        self.ran.append(cell.label())
        if cell.label() == self.interrupt:
            raise KeyboardInterrupt
        if cell.model == "resnet50" and cell.precision == "fp8":
            raise self.config_error("precision=fp8: no Linear layer of model=resnet50 can run")
        end = self.now + FAKE_SECONDS[cell.key]
        done = steps if end <= deadline else 0  # stopped in its warm-up: nothing timed
        self.now = min(end, deadline)
        figures = {
            "samples_per_s": 100.0 * (2 if cell.compile else 1) if done else None,
            "step_time_ms": 10.0,
            "tokens_per_s": 6400.0 if cell.model == "gpt" else None, "peak_memory_bytes": 2**30,
            "label": cell.precision, "measured_steps": done, "planned_steps": steps,
            "skipped_steps": 1, "skipped_in_window": 0,
        }  # fmt: skip
        return {**figures, "compile_s": 20.0} if cell.compile else figures


def fake_section(tmp_path, monkeypatch, *argv: str, interrupt: str | None = None):
    """A gpu_speed Section on FakeCells (cell_config passes the cell itself as its config)."""
    speed = load_script("gpu_speed.py")
    monkeypatch.setattr(speed, "cell_config", lambda base, cell: cell)
    args = speed.parse_args(["--device", "cpu", "--out", str(tmp_path / "t.json"), *argv])
    fake = FakeCells(speed.ConfigError, interrupt)
    configs = dict.fromkeys(speed.MODELS)  # unused: cell_config passes the cell itself
    section = speed.Section(args, configs, speed.document(args), fake.clock, fake.train)
    return speed, section, fake


@pytest.mark.slow  # torch._dynamo's first import (gpu_speed resets it after every cell): ~3 s
def test_gpu_speed_runs_the_cells_by_value_within_its_budget_and_says_what_it_skipped(
    tmp_path, monkeypatch
):
    """Eager cells first, then compiled ones by value (models alternating); a cell starts only
    when its estimate (the constant, then the longest cell of its model and mode) fits; one past
    its cap keeps its partial window; the JSON and the table on disk say which were not run."""
    _, section, fake = fake_section(
        tmp_path, monkeypatch, "--precisions", "fp32,bf16,fp8", "--budget-s", "100",
        "--cell-cap-s", "35",
    )  # fmt: skip
    section.run()

    eager = [f"{m} {p} compile off" for m in ("gpt", "resnet50") for p in ("fp32", "bf16", "fp8")]
    # gpt eager 3 x 4 s, resnet50 2 x 6 s (FP8 refused at once): 24 s, 76 s left. Compiled:
    # gpt bf16 (estimate 10 s) 30 s; resnet50 bf16 (estimate 15 s) stopped at its 35 s cap;
    # 11 s left: gpt fp8 (estimate now 30 s) and the rest do not fit; resnet50 fp8 is refused.
    assert fake.ran == [*eager, "gpt bf16 compile on", "resnet50 bf16 compile on"]
    doc = json.loads((tmp_path / "t.json").read_text())
    status = {(c["model"], c["precision"], c["compile"]): (c["status"], c["why"]) for c in doc["cells"]}  # fmt: skip
    assert status["resnet50", "bf16", True] == (
        "partial", "stopped at its cap after 0 of 1 timed steps"
    )  # fmt: skip
    assert status["resnet50", "fp8", True] == (
        "refused",
        "precision=fp8: no Linear layer of model=resnet50 can run (as compile off)",
    )
    assert status["gpt", "fp8", True] == (
        "not run",
        "budget: 11 s of the section left, ~30 s needed",
    )
    assert status["resnet50", "fp32", True] == (
        "not run",
        "budget: 11 s of the section left, ~35 s needed",
    )
    assert doc["not_run_for_budget"] == [
        "gpt fp8 compile on", "gpt fp32 compile on", "resnet50 fp32 compile on",
    ]  # fmt: skip
    compiled = next(c for c in doc["cells"] if c["model"] == "gpt" and c["compile"])["figures"]
    assert compiled["vs_eager"] == 2.0 and compiled["vs_fp32"] == 2.0
    assert "predicted_samples_per_s" not in compiled
    table = (tmp_path / "t.md").read_text()
    assert table == doc["markdown"]
    assert (
        "| gpt | bf16 | on | 200.0 | 6,400 | 2.00 | 2.00 | 10.0 | 1.00 GiB | 0/1 | 20.0 | - | - |  |"
        in table
    )
    assert (
        "| gpt | fp8 | on | - |" in table and "not run: budget: 11 s of the section left" in table
    )
    assert "- Not run for lack of budget: 3 cells (gpt fp8 compile on; gpt fp32" in table
    assert "- Predicted: mptrain.commands.advise.predict" in table  # the roofline, on a GPU


@pytest.mark.slow
def test_gpu_speed_stopped_mid_table_keeps_what_it_measured(tmp_path, monkeypatch):
    """gpu_all's SIGINT (KeyboardInterrupt) in a cell: that cell is recorded as stopped, the
    ones after it as not run, the measured ones kept, and both files written before it ends."""
    _, section, _ = fake_section(
        tmp_path, monkeypatch, "--models", "gpt", "--precisions", "fp32,bf16",
        interrupt="gpt bf16 compile off",
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        section.run()

    doc = json.loads((tmp_path / "t.json").read_text())
    assert [(c["status"], c["figures"].get("samples_per_s")) for c in doc["cells"]] == [
        ("ok", 100.0), ("stopped", None), ("not run", None), ("not run", None),
    ]  # fmt: skip
    why = doc["cells"][1]["why"]
    assert (
        why.startswith("the section was stopped (KeyboardInterrupt")
        and doc["cells"][3]["why"] == why
    )
    assert doc["not_run_for_budget"] == []
    assert "| gpt | bf16 | off | - |" in (tmp_path / "t.md").read_text()


@pytest.mark.slow
def test_gpu_speed_records_the_predictor_next_to_the_measurement(tmp_path, monkeypatch):
    """The hook: when mptrain has an advise predictor, every measured cell carries its figure
    and the ratio; cells not measured get none."""
    speed = load_script("gpu_speed.py")
    asked = []

    def predict(cfg):
        asked.append(cfg.label())
        return 400.0

    monkeypatch.setattr(speed, "load_predictor", lambda: (predict, "a test's predictor"))
    monkeypatch.setattr(speed, "cell_config", lambda base, cell: cell)
    args = speed.parse_args(["--device", "cpu", "--out", str(tmp_path / "t.json"), "--models",
                             "resnet50", "--precisions", "bf16,fp8", "--compile", "off"])  # fmt: skip
    fake = FakeCells(speed.ConfigError)
    speed.Section(
        args, dict.fromkeys(speed.MODELS), speed.document(args), fake.clock, fake.train
    ).run()

    doc = json.loads((tmp_path / "t.json").read_text())
    assert asked == ["resnet50 bf16 compile off"] and doc["predictor"] == "a test's predictor"
    bf16, fp8 = (c["figures"] for c in doc["cells"])
    assert bf16["predicted_samples_per_s"] == 400.0 and bf16["measured_over_predicted"] == 0.25
    assert "predicted_samples_per_s" not in fp8  # refused: nothing measured, nothing predicted
    table = doc["markdown"]
    assert "- Predicted: a test's predictor" in table and "| 400.0 |" in table


@pytest.mark.slow
def test_block_sqnr_ranks_the_formats(tmp_path):
    doc = run_to_json(
        "block_sqnr.py", "--rows", "128", "--features", "256", "--outliers", "1", cwd=tmp_path
    )
    sqnr = {row["format"]: row for row in doc["rows"]}
    assert set(sqnr) >= {"fp8 tensorwise", "fp8 rowwise", "mxfp8 rceil", "nvfp4 recipe"}
    assert sqnr["mxfp8 rceil"]["out"] > sqnr["nvfp4 1x16"]["out"] + 8  # 8-bit vs 4-bit elements
    assert all(math.isfinite(row[g]) for row in doc["rows"] for g in ("out", "dx", "dW"))


@pytest.mark.slow
def test_block_training_trains_every_format_and_pairs_it_with_fp32(tmp_path):
    doc = run_to_json(
        "block_training.py", "--jobs", "classify,lm", "--epochs", "1", "--lm-steps", "8",
        "--threads", "1", "--lm-overrides", "model.layers=1 model.block_size=32", cwd=tmp_path,
    )  # fmt: skip
    rows = {(r["job"], r["precision"]): r for r in doc["rows"]}
    formats = ("fp32", "bf16", "mxfp8", "nvfp4", "fp8_blockwise")
    assert list(rows) == [(job, p) for job in ("classify", "lm") for p in formats]
    for (job, precision), row in rows.items():
        assert row["status"] == "completed", row
        assert math.isfinite(row["final_val_loss"]) and row["step_time_ms"] > 0
        assert row["step_time_vs_fp32"] > 0 and row["val_loss_vs_fp32"] is not None
        assert row["label"].endswith("(emulated)") == (precision not in ("fp32", "bf16"))
        assert (row["final_val_accuracy"] is not None) == (job == "classify")
    assert rows["lm", "fp32"]["step_time_vs_fp32"] == 1.0 and rows["lm", "mxfp8"]["steps"] == 8
    assert "| lm | mxfp8 (emulated) | 8 |" in doc["markdown"]


@pytest.mark.slow
def test_block_quant_speed_times_each_format_against_fp32(tmp_path):
    doc = run_to_json(
        "block_quant_speed.py", "--tokens", "128", "--shapes", "128x128,256x128", "--rounds", "1",
        cwd=tmp_path,
    )  # fmt: skip
    figures = doc["figures"]
    parts = ("step", "quantize")
    expected = ["fp32 step", "fp32 gemm", *(f"{f} {p}" for f in ("mxfp8", "nvfp4") for p in parts)]
    assert list(figures) == [*expected, "fp8_blockwise step", "fp8_blockwise quantize"]
    assert all(f["cpu_ms_min"] > 0 and f["wall_ms_min"] > 0 for f in figures.values())
    assert "| mxfp8 step |" in doc["markdown"] and len(doc["load"]) == 2


@pytest.mark.slow
def test_state_dtype_tost_pairs_each_states_choice_with_fp32_per_seed(tmp_path):
    doc = run_to_json(
        "state_dtype_tost.py", "--width", "32", "--steps", "12", "--seeds", "0,1,2",
        "--variants", "bf16", cwd=tmp_path,  # 12 steps: the probe (every 10) sees the states
    )  # fmt: skip
    assert [(r["variant"], r["seed"]) for r in doc["rows"]] == [
        (v, s) for s in (0, 1, 2) for v in ("fp32", "bf16")
    ]
    bf16 = next(r for r in doc["rows"] if r["variant"] == "bf16")
    assert bf16["state_dtypes"] == ["bfloat16"] and set(bf16["states_lost_fraction"]) == {
        "exp_avg",
        "exp_avg_sq",
    }
    (verdict,) = doc["verdicts"]
    assert verdict["variant"] == "bf16" and verdict["seeds"] == verdict["reference_seeds"] == 3
    assert verdict["state_bytes_ratio"] > 1.9 and verdict["words"].startswith(
        "bf16 states vs FP32: "
    )
