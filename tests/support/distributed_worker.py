"""Run by tests/e2e/test_distributed.py under torchrun: one mptrain job, then each rank dumps its state.

    python -m torch.distributed.run --nproc_per_node=2 tests/support/distributed_worker.py OUT override...

Wraps mptrain.train.job.train_loop to save, per rank, the final parameters, this rank's buffers, the
loss scale and the skipped steps into OUT/rank<N>.pt, so the test can check that ranks agree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the support package

from mptrain.platform.distributed import model_state, unwrap
from mptrain.train import job as run_module
from support.runs import compose_run

real_loop = run_module.train_loop


def precomputed_scales(model):
    """torchao's FP8 all-gather: the weight scales precomputed for the next all-gather, by name."""
    scales = {}
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", param)  # FSDP2: a DTensor around torchao's tensor
        scale = getattr(local, "_precomputed_scale", None)
        if scale is not None:
            scales[name] = scale.detach().cpu().clone()
    return scales


def dumping_loop(run, hooks):
    state = real_loop(run, hooks)
    scaler = run.precision.scaler
    rank = int(os.environ.get("RANK", "0"))
    full = model_state(run.model, run.dist)  # collective under FSDP
    torch.save(
        {
            "params": {k: v.detach().cpu().clone() for k, v in full.items()},
            # This rank's own buffers (e.g. FP8 scales): unsharded, so each rank has all of them.
            "buffers": {k: v.cpu().clone() for k, v in unwrap(run.model).named_buffers()},
            "precomputed_scales": precomputed_scales(unwrap(run.model)),
            "scale": scaler.get_scale() if scaler.is_enabled() else None,
            "skipped": list(state.skipped_steps),
            "steps": state.step,
            "samples_seen": state.samples_seen,
        },
        Path(os.environ["MPTRAIN_TEST_OUT"]) / f"rank{rank}.pt",
    )
    return state


def pretend_fp8_gemms() -> None:
    """Let fp8.backend=torchao past mptrain's FP8-GPU check on the CPU (torchao's float8 training
    itself runs there: torch._scaled_mm has a CPU kernel). Only the capability check is faked."""
    from mptrain.precision import policy as precision

    precision.fp8_gemm_available = lambda device: True


def main() -> None:
    out = Path(sys.argv[1])
    os.environ["MPTRAIN_TEST_OUT"] = str(out)
    run_module.train_loop = dumping_loop
    if os.environ.get("MPTRAIN_TEST_PRETEND_FP8_GEMMS") == "1":
        pretend_fp8_gemms()
    device = os.environ.get("MPTRAIN_TEST_DEVICE", "cpu")  # cuda: one GPU per rank
    cfg = compose_run(f"device={device}", "progress=false", *sys.argv[2:])
    run_module.train(cfg, out / "run")


if __name__ == "__main__":
    main()
