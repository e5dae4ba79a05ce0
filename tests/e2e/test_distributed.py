"""Data-parallel training with 2 Gloo processes on the CPU (launched with torchrun)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.runs import tiny_run, train

from mptrain.checkpoint.file import load_checkpoint

WORKER = Path(__file__).resolve().parents[1] / "support" / "distributed_worker.py"


def torchrun(out: Path, *overrides: str, nproc: int = 2) -> list[dict]:
    """Run the worker on ``nproc`` ranks; return each rank's dumped state."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(WORKER), str(out), *overrides,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def params_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **tol)


@pytest.mark.slow
def test_ddp_two_ranks_of_16_match_one_process_of_32_in_fp32(tmp_path):
    common = ("model=mlp", "precision=fp32", "max_steps=8", "optimizer=sgd", "scheduler=constant")
    ranks = torchrun(tmp_path / "ddp", *common, "batch_size=16")
    single = torchrun(tmp_path / "single", *common, "batch_size=32", nproc=1)[0]

    # Each rank took its own 16 of the same 32 samples: DDP's averaged gradient equals the
    # single process's gradient of the mean over 32 (close, not bitwise: summation order).
    params_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    params_close(ranks[0]["params"], single["params"], rtol=1e-5, atol=1e-6)
    assert ranks[0]["samples_seen"] == single["samples_seen"] == 8 * 32
    report = json.loads((tmp_path / "ddp" / "run" / "report.json").read_text())
    assert report["distributed"] == {
        "world_size": 2,
        "rank": 0,
        "backend": "gloo",
        "strategy": "ddp",
        "reduce_dtype": "float32",
        # How the ranks were started and how long a collective waits for a lost one.
        "launcher": "torchrun",
        "nodes": 1,
        "tasks": 2,
        "restart": 0,
        "timeout_s": 600.0,
        "lost_ranks": None,
    }
    assert report["data"]["effective_batch_size"] == 32


@pytest.mark.slow
def test_inf_on_rank_1_only_makes_both_ranks_skip_and_back_off(tmp_path):
    ranks = torchrun(
        tmp_path,
        "model=mlp",
        "precision=fp16",
        "max_steps=6",
        "debug.inject_inf_grad_steps=[3]",
        "debug.inject_inf_grad_rank=1",
    )
    for state in ranks:
        assert state["skipped"] == [3]
        assert state["scale"] == 65536.0 / 2
    params_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.slow
def test_only_rank_0_writes(tmp_path):
    torchrun(tmp_path, "model=mlp", "precision=bf16", "max_steps=4", "checkpoint.every_steps=2")
    run_dir = tmp_path / "run"
    written = sorted(p.name for p in run_dir.iterdir())
    assert written == ["checkpoints", "curves.png", "metrics.jsonl", "report.json", "report.md"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["kind"] == "eval"]) == 1  # one writer, not two
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt")) == [
        "step_00000002.pt",
        "step_00000004.pt",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_trains_and_its_checkpoint_resumes_in_one_process(tmp_path, precision):
    ranks = torchrun(
        tmp_path,
        "model=mlp",
        f"precision={precision}",
        "distributed.strategy=fsdp",
        "max_steps=6",
        "checkpoint.every_steps=3",
        *(
            ["debug.inject_inf_grad_steps=[2]", "debug.inject_inf_grad_rank=1"]
            if precision == "fp16"
            else []
        ),
    )
    # The full state dict is gathered on rank 0 only; ranks agree on every step's outcome.
    assert ranks[1]["params"] == {}
    assert ranks[0]["scale"] == ranks[1]["scale"]
    if precision == "fp16":  # the sharded scaler agreed: both ranks skipped step 2
        assert [r["skipped"] for r in ranks] == [[2], [2]]
        assert ranks[0]["scale"] == 65536.0 / 2
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["distributed"]["strategy"] == "fsdp"
    saved = load_checkpoint(run_dir / "checkpoints" / "step_00000006.pt")
    params_close(saved["model"], ranks[0]["params"], rtol=0, atol=0)

    # A different world size (1) loads the full state dict and trains on.
    cfg = tiny_run(
        f"precision={precision}", "max_steps=9", f"resume={run_dir}", "resume_allow_changes=true"
    )
    resumed = train(cfg, tmp_path / "resumed")
    assert resumed["status"] == "completed" and resumed["resumed"]["step"] == 6
    assert any("world size 2" in note for note in resumed["resumed"]["notes"])


@pytest.mark.slow
def test_time_cadences_agree_across_ranks_at_log_rows(tmp_path):
    """A clock read on each rank could make one rank save (a collective under FSDP) or evaluate
    (an all-reduce) without the other: time cadences are decided at log rows, by rank 0."""
    torchrun(
        tmp_path,
        "model=mlp",
        "precision=bf16",
        "max_steps=7",
        "log_every=3",
        "eval_every_minutes=1e-9",
        "checkpoint.every_minutes=1e-9",
        "checkpoint.keep_last=10",
        "distributed.strategy=fsdp",
    )
    run_dir = tmp_path / "run"
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert saved == ["step_00000003.pt", "step_00000006.pt", "step_00000007.pt"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 6, 7]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_language_model_trains_on_two_ranks(tmp_path, strategy):
    """task=lm under torchrun: ranks stay identical, the validation windows are split between
    them and the sums all-reduced (the report's loss is the whole validation set's)."""
    tiny = ("model.layers=1", "model.width=32", "model.heads=2", "model.block_size=16")
    tiny += ("dataset.max_bytes=30000", "dataset.val_windows=15", "batch_size=4")
    ranks = torchrun(
        tmp_path, "task=lm", *tiny, "precision=bf16", "max_steps=6", "eval_every=6",
        f"distributed.strategy={strategy}",
    )  # fmt: skip
    if strategy == "ddp":  # FSDP holds one sharded copy (gathered on rank 0 only)
        params_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 6
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed" and report["evaluation"]["task"] == "lm"
    assert report["distributed"]["strategy"] == strategy
    assert report["data"]["effective_batch_size"] == 8
    assert report["throughput"]["tokens_per_s"] > 0
    loss = report["evaluation"]["final_val_loss"]
    assert math.isfinite(loss) and loss < math.log(256)


# ------------------------------------------------------------------------------ FP8
FP8_MLP = ("model=mlp", "precision=fp8", "batch_size=16", "optimizer=sgd", "scheduler=constant")
LAYER_3_INPUTS_PER_STEP = 16 * 256  # rows x in_features of the MLP's one FP8 layer, per rank
LAYER_3_WEIGHT = 256 * 256  # every rank casts the whole (FSDP: all-gathered) weight


def fp8_buffers(buffers: dict) -> dict:
    """The FP8 scalers' buffers (scales, amax histories, counters) of a state dict."""
    return {k: v for k, v in buffers.items() if "_scaler." in k}


@pytest.mark.slow
def test_fp8_delayed_scaling_state_is_the_same_on_every_rank_and_fsdp_computes_like_ddp(tmp_path):
    """Delayed scaling reduces the amax histories with MAX over the ranks and sums the counters:
    both ranks hold the same FP8 state. FSDP's FP8 layer quantizes its FP32 weight (gathered in
    FP32), so FSDP and DDP, fed the same shards, train the same weights and hold the same FP8
    state. (DDP alone broadcast rank 0's buffers before each step: the same everywhere, but rank
    1's amaxes and casts were lost.)"""
    common = (*FP8_MLP, "fp8.scaling=delayed", "max_steps=4", "grad_accum_steps=2")
    runs = {
        s: torchrun(tmp_path / s, *common, f"distributed.strategy={s}") for s in ("ddp", "fsdp")
    }
    for ranks in runs.values():
        params_close(
            fp8_buffers(ranks[0]["buffers"]), fp8_buffers(ranks[1]["buffers"]), rtol=0, atol=0
        )
        buffers = ranks[0]["buffers"]
        # 4 steps of 2 micro-batches on each of 2 ranks
        assert buffers["3.input_scaler.seen"] == 4 * 2 * 2 * LAYER_3_INPUTS_PER_STEP
        assert buffers["3.weight_scaler.seen"] == 4 * 2 * 2 * LAYER_3_WEIGHT
    fsdp, ddp = (fp8_buffers(runs[s][0]["buffers"]) for s in ("fsdp", "ddp"))
    params_close(fsdp, ddp, rtol=0, atol=0)
    params_close(runs["fsdp"][0]["params"], runs["ddp"][0]["params"], rtol=1e-5, atol=1e-6)
    report = json.loads((tmp_path / "fsdp" / "run" / "report.json").read_text())["fp8"]
    assert report["amax_reduction"].startswith("max over 2 ranks, once per optimizer step")
    assert report["counters"] == "summed over 2 ranks"
    assert report["weight_all_gather_dtype"] == "float32"


@pytest.mark.slow
def test_fsdp_fp8_delayed_checkpoint_is_every_ranks_state_and_resumes(tmp_path):
    """Rank 0's checkpoint holds the FP8 state of both ranks; a run resumed from it at the same
    world size continues as the uninterrupted run did (histories, scales and job-wide counters
    included), and a single process resumes from it too."""
    common = (
        *FP8_MLP,
        "fp8.scaling=delayed",
        "distributed.strategy=fsdp",
        "checkpoint.every_steps=2",
    )
    straight = torchrun(tmp_path / "straight", *common, "max_steps=6")
    first = torchrun(tmp_path / "first", *common, "max_steps=4")
    run_dir = tmp_path / "first" / "run"
    saved = fp8_buffers(load_checkpoint(run_dir / "checkpoints" / "step_00000004.pt")["model"])
    assert saved
    for rank in first:
        params_close(fp8_buffers(rank["buffers"]), saved, rtol=0, atol=0)

    resumed = torchrun(
        tmp_path / "second",
        *common,
        "max_steps=6",
        f"resume={run_dir}",
        "resume_allow_changes=true",
    )
    for rank in resumed:
        params_close(fp8_buffers(rank["buffers"]), fp8_buffers(straight[0]["buffers"]))
    params_close(resumed[0]["params"], straight[0]["params"], rtol=1e-5, atol=1e-6)
    assert resumed[0]["buffers"]["3.input_scaler.seen"] == 6 * 2 * LAYER_3_INPUTS_PER_STEP

    single = train(
        tiny_run(
            "precision=fp8", "fp8.scaling=delayed", "batch_size=16", "max_steps=6",
            f"resume={run_dir}", "resume_allow_changes=true",
        ),
        tmp_path / "single",
    )  # fmt: skip
    assert single["status"] == "completed" and single["resumed"]["step"] == 4
    assert any("world size 2" in note for note in single["resumed"]["notes"])


@pytest.mark.slow
def test_fp8_language_model_with_dynamic_scaling_under_fsdp(tmp_path):
    """Dynamic scaling: input and grad scales are each rank's own; a weight's amax is taken over
    the all-gathered weight, so weight scales agree; the counters count both ranks' casts."""
    tiny = ("model.layers=1", "model.width=32", "model.heads=2", "model.block_size=16")
    tiny += ("dataset.max_bytes=30000", "dataset.val_windows=15", "batch_size=4")
    ranks = torchrun(
        tmp_path, "task=lm", *tiny, "precision=fp8", "max_steps=4", "eval_every=4",
        "distributed.strategy=fsdp",
    )  # fmt: skip
    a, b = (fp8_buffers(r["buffers"]) for r in ranks)
    assert len(a) == 4 * 3 * 6  # qkv, attn.proj, mlp.fc, mlp.proj; 3 roles; 6 buffers each
    agreed = [k for k in a if "weight_scaler" in k or k.endswith(("seen", "saturated", "casts"))]
    params_close({k: a[k] for k in agreed}, {k: b[k] for k in agreed}, rtol=0, atol=0)
    assert a["blocks.0.mlp.fc.input_scaler.seen"] == 4 * 2 * (4 * 16) * 32  # steps, ranks, rows, K
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["fp8"]["amax_reduction"].startswith("none: dynamic scaling")


@pytest.mark.slow
def test_torchao_fp8_under_fsdp_all_gathers_in_fp8_with_scales_precomputed_after_each_step(
    tmp_path, monkeypatch
):
    """fp8.backend=torchao under FSDP2: torchao's FP8 weight all-gather, whose scales are
    precomputed after every optimizer step. torchao's float8 training runs on the CPU; only
    mptrain's FP8-GPU check is bypassed (in the worker)."""
    monkeypatch.setenv("MPTRAIN_TEST_PRETEND_FP8_GEMMS", "1")
    ranks = torchrun(
        tmp_path, "model=mlp", "precision=fp8", "fp8.backend=torchao", "fp8.keep_first_last=false",
        "max_steps=3", "distributed.strategy=fsdp",
    )  # fmt: skip
    weights = {k: v for k, v in ranks[0]["params"].items() if k.endswith("weight")}
    fp8_weights = ["1.weight", "3.weight"]  # the 10-class head is not 16-aligned
    for rank in ranks:
        assert sorted(rank["precomputed_scales"]) == fp8_weights
        for name in fp8_weights:  # from the final weights: computed after the last step
            expected = (448.0 / weights[name].double().abs().max()).float()
            torch.testing.assert_close(rank["precomputed_scales"][name], expected)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["fp8"]["weight_all_gather_dtype"] == "float8_e4m3fn"


requires_two_fp8_gpus = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.device_count() < 2
    or torch.cuda.get_device_capability(0) < (8, 9),
    reason="needs 2 GPUs of compute capability >= 8.9 (one per rank)",
)


@pytest.mark.gpu
@requires_two_fp8_gpus
@pytest.mark.parametrize(
    ("backend", "gather_dtype"), [("builtin", "float32"), ("torchao", "float8_e4m3fn")]
)
def test_real_fp8_gemms_under_fsdp_on_two_gpus(tmp_path, monkeypatch, backend, gather_dtype):
    """The real thing (NCCL, torch._scaled_mm): FP8 layers under FSDP2 with each backend."""
    monkeypatch.setenv("MPTRAIN_TEST_DEVICE", "cuda")
    scaling = "delayed" if backend == "builtin" else "dynamic"
    ranks = torchrun(
        tmp_path, "model=mlp", "precision=fp8", f"fp8.backend={backend}", "fp8.emulate=false",
        f"fp8.scaling={scaling}", "fp8.keep_first_last=false", "max_steps=3",
        "distributed.strategy=fsdp",
    )  # fmt: skip
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed" and report["precision"]["emulated"] is False
    assert report["fp8"]["weight_all_gather_dtype"] == gather_dtype
    params_close(fp8_buffers(ranks[0]["buffers"]), fp8_buffers(ranks[1]["buffers"]), rtol=0, atol=0)
    if backend == "torchao":
        assert ranks[0]["precomputed_scales"].keys() == {"1.weight", "3.weight"}
        for name, scale in ranks[0]["precomputed_scales"].items():
            torch.testing.assert_close(scale, ranks[1]["precomputed_scales"][name])


@pytest.mark.slow
def test_a_refusal_on_rank_0_stops_every_rank_with_it(tmp_path):
    """Rank 0 alone checks the run directory: the others stop with its refusal, not in their
    first collective until torchrun kills them."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_00000004.pt").write_bytes(b"another run's")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(WORKER), str(tmp_path), "model=mlp", "max_steps=2",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    refusal = f"run directory {tmp_path / 'run'}: holds another run's checkpoints"
    assert f"ConfigError: {refusal}" in output, output[-3000:]  # rank 0
    assert f"ConfigError: rank 0 refused the job: {refusal}" in output, output[-3000:]  # rank 1
