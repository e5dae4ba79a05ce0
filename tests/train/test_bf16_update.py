"""``precision.update`` (mptrain.precision.update): pure low-precision weights updated by
stochastic rounding or Kahan compensation instead of rounding to nearest.

What is checked: tiny updates that nearest rounding loses are kept (in expectation, or in the
Kahan buffer) and the lost-update probe says so; the hooks leave the optimizer's objects as they
were; the update equals torchao's BF16 stochastic-rounding AdamW bit for bit wherever the two
FP32 computations agree; a resumed run is bit for bit an uninterrupted one; ``nearest`` installs
nothing (torch's own step, as before); the config key's rules; the report's field. The end-to-end
evidence (a short run whose plain BF16 loses over half of its updates) is the slow test at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command
from support.runs import NoFigure, compose_run, tiny_run, train

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.config.precision import PrecisionConfig, validate_precision
from mptrain.platform.distributed import DistContext
from mptrain.precision.policy import resolve_precision
from mptrain.precision.rounding import stochastic_round
from mptrain.precision.update import WeightUpdate, build_weight_update
from mptrain.train import job
from mptrain.train.build import check_run, prepare_run
from mptrain.train.loop import UpdateProbe

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr(job, "FigureWorker", NoFigure)  # no curves.png: not read here


# ------------------------------------------------------------------------------ tiny updates
def constant_descent(rule: str, steps: int, n: int = 20_000, lr: float = 1e-3):
    """SGD from weights 1.0 (BF16) down a constant gradient of 1: each update (1e-3) is under
    half a BF16 spacing below 1.0 (2**-9), so rounding to nearest loses every one. Returns
    (parameter, its WeightUpdate or None, lost-update probe fractions of each step)."""
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([p], lr=lr)
    update = build_weight_update(optimizer, rule, run_seed=0, device=CPU)
    lost = []
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        probe = UpdateProbe([p], update)
        optimizer.step()
        lost.append(probe.updates_lost_fraction())
    return p, update, lost


def test_nearest_loses_every_tiny_update_and_installs_nothing():
    p, update, lost = constant_descent("nearest", steps=10)
    assert update is None
    assert torch.all(p == 1.0) and lost == [1.0] * 10


def test_stochastic_rounding_keeps_tiny_updates_in_expectation():
    """After 100 updates of -1e-3 the FP32 weight is 0.9. Each step's rounding error is at most
    one spacing (2**-8 below 1.0) with variance <= spacing**2 / 4, so a weight's error after 100
    independent roundings has a standard deviation <= 10 * 2**-9, and the mean of 20,000 such
    weights one of <= 1.4e-4: within 7e-4 (5 of those) of 0.9, where nearest stays at 1.0."""
    p, update, lost = constant_descent("stochastic", steps=100)
    exact = torch.ones(1)
    for _ in range(100):
        exact -= 1e-3
    assert abs(p.float().mean().item() - exact.item()) <= 7e-4
    assert p.float().std().item() > 0  # the weights took different draws
    assert lost == [0.0] * 100  # the probe: every update had a chance to move its weight
    assert p.dtype == torch.bfloat16 and update.generator is not None


def test_kahan_weight_plus_buffer_carries_every_update():
    p, update, lost = constant_descent("kahan", steps=100)
    exact = torch.ones(1)
    for _ in range(100):
        exact -= 1e-3
    (buffer,) = update.compensation
    assert buffer.dtype == torch.bfloat16
    carried = p.detach().float() + buffer.float()
    # The buffer is BF16 too: it holds less than half a weight spacing (2**-9), rounded to its
    # own spacing (<= 2**-16), so each step may drop up to 2**-17: 100 steps, 7.6e-4 at most.
    # Nearest rounding dropped all of 0.1.
    assert torch.all((carried - exact).abs() <= 100 * 2**-17)
    assert torch.all((p.float() - exact).abs() <= 2**-8)  # within a spacing at 0.9
    assert lost == [0.0] * 100


def test_the_hooks_leave_the_optimizers_objects_as_they_were():
    """Same Parameter objects and storage, BF16 weights, gradients and moments between steps,
    torch's FP32 step counts untouched; the update is the FP32 math's, rounded by the rule."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    update = WeightUpdate(optimizer, "stochastic", seed=3, device=CPU)
    storages = [p.data_ptr() for p in model.parameters()]
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        model(torch.randn(5, 8).bfloat16()).sum().backward()
        grads = [p.grad for p in model.parameters()]
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.data = p.data.float()  # the FP32 math from the same BF16 weights...
            q.grad = p.grad.float()
            for key in ("exp_avg", "exp_avg_sq"):  # ...and the same BF16 moments
                if key in optimizer.state.get(p, {}):
                    reference.state[q][key] = optimizer.state[p][key].float()
        optimizer.step()
        reference.step()
        for p, q, grad in zip(model.parameters(), twin.parameters(), grads, strict=True):
            assert p.dtype == torch.bfloat16 and p.grad is grad
            assert torch.equal(p.data, stochastic_round(q.data, generator=g))
            state = optimizer.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert state["step"].dtype == torch.float32
        model.zero_grad(set_to_none=True)
    assert [p.data_ptr() for p in model.parameters()] == storages
    update.remove()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_stochastic_needs_bf16_weights_and_rules_are_named():
    fp16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="BF16 parameters"):
        WeightUpdate(torch.optim.SGD([fp16], lr=1), "stochastic", seed=0, device=CPU)
    with pytest.raises(ValueError, match="stochastic or kahan"):
        WeightUpdate(torch.optim.SGD([fp16], lr=1), "nearest", seed=0, device=CPU)
    WeightUpdate(torch.optim.SGD([fp16], lr=1), "kahan", seed=0, device=CPU)  # FP16 takes Kahan


# --------------------------------------------------------------------------------- torchao
def adamw_pair(seed: int):
    """Three BF16 tensors with BF16 gradients, as parameters of torch's AdamW under
    ``precision.update=stochastic`` (random bits from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(128, 64), (64,), (10, 128)]
    weights = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-2).bfloat16() for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad.clone()
    return weights, grads, params


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def test_one_adamw_step_equals_torchaos_wherever_the_fp32_math_agrees():
    """torchao's BF16 AdamW (``bf16_stochastic_round=True``) runs ``single_param_adam``: FP32 math,
    moments stored in BF16, the weight rounded by ``_fp32_to_bf16_sr`` with bits from torch's
    global generator. Ours runs torch's AdamW in FP32 and ``stochastic_round`` with the same
    bits. The two order their FP32 operations differently, so a few FP32 results differ in the
    last bit; wherever they agree the BF16 weights agree bit for bit, and the rest lie one BF16
    spacing apart at most (called here without torch.compile, which torchao's class adds): a
    last-bit difference changes the rounding only where the random threshold falls between the
    two results, for a few elements in ten thousand."""
    adam = pytest.importorskip("torchao.optim.adam")
    weights, grads, params = adamw_pair(seed=0)
    optimizer = torch.optim.AdamW(params, **ADAMW, fused=True)
    update = WeightUpdate(optimizer, "stochastic", seed=5, device=CPU)
    update.keep_results(True)
    optimizer.step()
    same = total = 0
    torch.manual_seed(5)  # torchao draws from the global generator, in the same order
    for p, w, grad in zip(params, weights, grads, strict=True):
        theirs_fp32 = w.float()
        args = (grad, torch.tensor(1.0), torch.zeros_like(w), torch.zeros_like(w), None)
        settings = (torch.tensor(ADAMW["lr"]), *ADAMW["betas"], ADAMW["weight_decay"])
        adam.single_param_adam(theirs_fp32, *args, *settings, ADAMW["eps"], True, False)
        theirs = w.clone()
        args = (grad, torch.tensor(1.0), torch.zeros_like(w), torch.zeros_like(w), None)
        adam.single_param_adam(theirs, *args, *settings, ADAMW["eps"], True, True)
        same_fp32 = update.landing(p).view(torch.int32) == theirs_fp32.view(torch.int32)
        ours_bits, their_bits = p.data.view(torch.int16), theirs.view(torch.int16)
        assert torch.equal(ours_bits[same_fp32], their_bits[same_fp32])
        assert (ours_bits.int() - their_bits.int()).abs().max() <= 1
        assert same_fp32.float().mean() > 0.5  # the FP32 math mostly agrees to the last bit
        same, total = same + int((ours_bits == their_bits).sum()), total + w.numel()
    assert same / total >= 0.999, f"{same} of {total} BF16 weights bit-identical"


@pytest.mark.slow
def test_adamw_steps_match_torchaos_compiled_optimizer():
    """torchao's ``_AdamW`` class itself (compiled by torch.compile; its random bits from eager
    torch.randint under inductor's ``fallback_random``): over 5 steps at least 99.9% of weights
    bit-identical, the rest a few spacings apart at most (FP32 rounding differences compound)."""
    optim = pytest.importorskip("torchao.optim")
    # inductor's own patch, undone on exit (a monkeypatch's undo leaves its config module without
    # the key, and every later compile in the process fails)
    with torch._inductor.config.patch(fallback_random=True):
        compare_with_torchao(optim)


def compare_with_torchao(optim) -> None:
    _, grads, params = adamw_pair(seed=1)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = torch.optim.AdamW(params, **ADAMW, fused=True)
    WeightUpdate(optimizer, "stochastic", seed=9, device=CPU)
    reference = optim._AdamW(theirs, **ADAMW, bf16_stochastic_round=True)
    torch.manual_seed(9)
    for step in range(5):
        for p, q, grad in zip(params, theirs, grads, strict=True):
            p.grad, q.grad = grad * (step + 1), grad * (step + 1)
        optimizer.step()
        reference.step()
        ours = torch.cat([p.data.view(torch.int16).reshape(-1).int() for p in params])
        their = torch.cat([q.data.view(torch.int16).reshape(-1).int() for q in theirs])
        assert (ours == their).float().mean() >= 0.999
        assert (ours - their).abs().max() <= 32


# ------------------------------------------------------------------------------ runs, resume
def test_nearest_is_torchs_own_step():
    run = prepare_run(tiny_run("precision=bf16_pure", "max_steps=1"))
    assert run.precision.update is None
    assert not run.optimizer._optimizer_step_pre_hooks


@pytest.mark.slow
def test_ddp_ranks_round_alike_and_average_their_gradients(tmp_path):
    """Every rank draws the same bits and keeps the same buffers, so the replicas stay equal; and
    the hooks never change a parameter's dtype in place (that would reset its gradient
    accumulator, where DDP's all-reduce hooks hang: ranks then step on their own gradients)."""
    from e2e.test_distributed import torchrun

    for rule in ("stochastic", "kahan"):
        common = ("model=mlp", "precision=bf16_pure", f"precision.update={rule}", "max_steps=6")
        ranks = torchrun(tmp_path / rule, *common)
        assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
        for key, value in ranks[0]["params"].items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, ranks[1]["params"][key])


@pytest.mark.parametrize("rule", ["stochastic", "kahan"])
def test_resumed_run_rounds_as_the_uninterrupted_one(tmp_path, rule):
    """Checkpoints at steps 4 and 8 of one run; a second run resumed from step 4 writes its own
    step 8: weights, optimizer state, the rounding generator and the Kahan buffers equal."""
    common = ("precision=bf16_pure", f"precision.update={rule}", "max_steps=8")
    straight = tmp_path / "straight"
    train(tiny_run(*common, "checkpoint.every_steps=4", "checkpoint.keep_last=2"), straight)
    stop = straight / "checkpoints" / "step_00000004.pt"
    report = train(tiny_run(*common, "checkpoint.every_steps=8", f"resume={stop}"), tmp_path / "r")
    assert report["resumed"]["step"] == 4 and report["resumed"]["notes"] == []
    assert report["precision"]["update"] == rule
    mine = load_checkpoint(tmp_path / "r" / "checkpoints" / "step_00000008.pt")
    theirs = load_checkpoint(straight / "checkpoints" / "step_00000008.pt")
    for key, value in theirs["model"].items():
        assert value.dtype == torch.bfloat16 and torch.equal(mine["model"][key], value), key
    for index, state in theirs["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(mine["optimizer"]["state"][index][key], value), (index, key)
    assert mine["update"]["rule"] == theirs["update"]["rule"] == rule
    if rule == "stochastic":
        assert torch.equal(mine["update"]["generator"], theirs["update"]["generator"])
        assert not torch.equal(
            theirs["update"]["generator"], load_checkpoint(stop)["update"]["generator"]
        )
    else:
        pairs = zip(mine["update"]["compensation"], theirs["update"]["compensation"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        assert any(c.abs().sum() > 0 for c in theirs["update"]["compensation"])


def test_a_changed_rule_resumes_only_when_allowed_and_says_its_state_starts_fresh(tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_run("precision=bf16_pure", "max_steps=2", "checkpoint.every_steps=2"), run_dir)
    path = run_dir / "checkpoints" / "step_00000002.pt"
    assert load_checkpoint(path)["update"] is None  # nearest keeps nothing
    changed = ("precision=bf16_pure", "precision.update=kahan", "max_steps=3", f"resume={path}")
    with pytest.raises(ConfigError, match=r"precision\.update: checkpoint 'nearest', now 'kahan'"):
        train(tiny_run(*changed), tmp_path / "refused")
    report = train(tiny_run(*changed, "resume_allow_changes=true"), tmp_path / "allowed")
    assert report["resumed"]["notes"] == [
        "precision.update changed (nearest -> kahan): its random bits and Kahan buffers start fresh"
    ]


# ---------------------------------------------------------------------------- config, report
def test_the_key_is_checked_against_the_precision():
    assert compose_run("precision=bf16_pure", "precision.update=stochastic").precision.update == (
        "stochastic"
    )
    assert compose_run("precision=fp16_pure", "precision.update=kahan").precision.update == "kahan"
    assert compose_run("precision=bf16-true", "precision.update=kahan").precision.update == "kahan"
    cases = {
        ("bf16_pure", "round"): "nearest or stochastic or kahan",
        ("bf16", "kahan"): "only for pure low-precision weights",
        ("auto", "stochastic"): "only for pure low-precision weights",
        ("fp16_pure", "stochastic"): "accepts nearest or kahan",
    }
    for (name, rule), words in cases.items():
        with pytest.raises(ConfigError, match=rf"^precision\.update='{rule}': ") as info:
            validate_precision(PrecisionConfig(name=name, update=rule))
        assert words in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^precision\.update='kahan': only for pure"):
        compose_run("precision=fp32", "precision.update=kahan")  # the same check at compose time


def test_fsdp_is_refused_by_name():
    cfg = compose_run("model=mlp", "precision=bf16_pure", "precision.update=stochastic")
    dist = DistContext(world_size=2, strategy="fsdp")
    policy = resolve_precision(cfg.precision, CPU, cfg.fp8)
    with pytest.raises(ConfigError, match=r"^precision\.update=stochastic: not under .*fsdp"):
        check_run(cfg, policy, dist)


def test_the_report_records_the_rule(tmp_path):
    report = train(
        tiny_run("precision=bf16_pure", "precision.update=kahan", "max_steps=2"), tmp_path
    )
    assert report["precision"]["update"] == "kahan"
    assert (
        "loss scaling off; weight updates Kahan-compensated" in (tmp_path / "report.md").read_text()
    )
    mixed = json.loads((tmp_path / "report.json").read_text())["precision"]
    assert mixed["master_weights"] is False and mixed["update"] == "kahan"


# ------------------------------------------------------------------------------- the evidence
@pytest.mark.slow
def test_a_short_run_that_plain_bf16_loses_half_its_updates_in(tmp_path):
    """60 AdamW steps at lr 3e-4 on digits: pure BF16 rounding to nearest loses over half of the
    updates (the probe, every step) and ends with a validation loss well above FP32's; stochastic
    rounding and Kahan compensation lose almost none and end within 0.01 of FP32.
    (Measured: FP32 1.629; nearest 1.739, 56% lost; stochastic 1.631, 0.01%; kahan 1.630, 1.1%.)"""
    common = ("max_steps=60", "optimizer.lr=3e-4", "probe_every=1", "eval_every=60")
    cases = {
        "fp32": ("fp32", "nearest"),
        "nearest": ("bf16_pure", "nearest"),
        "stochastic": ("bf16_pure", "stochastic"),
        "kahan": ("bf16_pure", "kahan"),
    }
    runs = {
        name: train(tiny_run(*common, f"precision={p}", f"precision.update={u}"), tmp_path / name)
        for name, (p, u) in cases.items()
    }
    lost = {rule: r["training"]["updates_lost_fraction"] for rule, r in runs.items()}
    loss = {rule: r["evaluation"]["final_val_loss"] for rule, r in runs.items()}
    assert lost["nearest"] > 0.5
    assert lost["stochastic"] < 0.01 and lost["kahan"] < 0.05
    assert loss["nearest"] - loss["fp32"] > 0.05
    for rule in ("stochastic", "kahan"):
        assert abs(loss[rule] - loss["fp32"]) < 0.01, (rule, loss)


@pytest.mark.slow
def test_the_benchmark_script_measures_every_variant(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    args = ("--jobs", "mlp", "--lrs", "3e-4", "--mlp-steps", "30", "--out", str(out))
    env = {"PYTHONPATH": str(repo)}  # python -m benchmarks.NAME from anywhere
    result = run_command(tmp_path, sys.executable, "-m", "benchmarks.bf16_update", *args, env=env)
    assert result.returncode == 0, describe(result)
    rows = {(r["precision"], r["update"]): r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [
        ("fp32", "nearest"),
        ("bf16_pure", "nearest"),
        ("bf16_pure", "stochastic"),
        ("bf16_pure", "kahan"),
    ]
    assert rows["bf16_pure", "nearest"]["updates_lost_fraction"] > 0.3
    assert rows["bf16_pure", "stochastic"]["updates_lost_fraction"] < 0.01
    assert rows["fp32", "nearest"]["val_loss_minus_fp32"] == 0.0
    assert all(r["samples_per_s"] > 0 for r in rows.values())
