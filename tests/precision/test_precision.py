"""Precision policy: auto resolution per hardware (mocked), refusals, scaler creation, TF32 flags."""

from __future__ import annotations

import pytest
import torch
from support.runs import restored_tf32

from mptrain.config.base import ConfigError
from mptrain.config.precision import PrecisionConfig
from mptrain.platform import hardware
from mptrain.precision.policy import apply_tf32, build_grad_scaler, resolve_precision

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


def precision(name: str) -> PrecisionConfig:
    return PrecisionConfig(name=name)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of a chosen compute capability is present."""

    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(hardware, "cuda_capability", lambda device: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")

    return install


def test_auto_picks_bf16_on_cpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    policy = resolve_precision(precision("auto"), CPU)
    assert (policy.requested, policy.name, policy.autocast_dtype) == (
        "auto",
        "bf16",
        torch.bfloat16,
    )
    assert not policy.loss_scaling
    assert "BF16" in policy.reason


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_resolves_by_a_rule_and_says_so(monkeypatch, native_bf16):
    """resolve_precision's basis is the device rule, stated in the reason (the report's
    "precision choice"); timing the model is the job's step after it (test_autoprecision.py)."""
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native_bf16)
    reason = resolve_precision(precision("auto"), CPU).reason
    assert reason.startswith("rule: ")
    assert ("executes BF16 natively" in reason) is native_bf16


def test_auto_picks_fp32_on_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    policy = resolve_precision(precision("auto"), CPU)
    assert (policy.name, policy.autocast_dtype, policy.loss_scaling) == ("fp32", None, False)


@pytest.mark.parametrize(
    ("capability", "expected", "scaled"),
    [
        ((9, 0), "bf16", False),
        ((8, 0), "bf16", False),
        ((7, 5), "fp16", True),
        ((6, 0), "fp16", True),
    ],
)
def test_auto_on_gpus(fake_gpu, capability, expected, scaled):
    fake_gpu(capability)
    policy = resolve_precision(precision("auto"), GPU)
    assert policy.name == expected and policy.loss_scaling is scaled
    assert f"{capability[0]}.{capability[1]}" in policy.reason
    if scaled:  # auto's fp16 keeps the configured scaler settings
        assert policy.scaler.init_scale == 65536.0 and policy.scaler.growth_interval == 2000


def test_bf16_on_gpu_without_bf16_is_refused_with_alternative(fake_gpu):
    fake_gpu((7, 5))
    with pytest.raises(ConfigError) as err:
        resolve_precision(precision("bf16"), GPU)
    message = str(err.value)
    assert "precision=bf16" in message and "7.5" in message and "fp16" in message
    assert "\n" not in message


def test_explicit_choices_are_kept_and_labelled_requested():
    for name, dtype in (("fp32", None), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        policy = resolve_precision(precision(name), CPU)
        assert (policy.requested, policy.name, policy.autocast_dtype) == (name, name, dtype)
        assert policy.reason == "requested"


def test_fp16_on_cpu_carries_a_slowness_note():
    policy = resolve_precision(precision("fp16"), CPU)
    assert any("slow" in note for note in policy.notes)


def test_fp16_without_scaling_is_flagged():
    policy = resolve_precision(precision("fp16_noscale"), CPU)
    assert not policy.loss_scaling
    assert any("underflow" in note for note in policy.notes)


def test_fp16_scaler_is_created_for_the_cpu_and_enabled():
    scaler = build_grad_scaler(resolve_precision(precision("fp16"), CPU))
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    assert scaler._device == "cpu"


def test_scaler_disabled_for_bf16_and_fp32():
    for name in ("bf16", "fp32"):
        assert not build_grad_scaler(resolve_precision(precision(name), CPU)).is_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_scaler_torch_disables_is_an_error_not_a_warning():
    """GradScaler('cuda') on a CPU-only machine disables itself with a warning: we refuse that."""
    policy = resolve_precision(precision("fp16"), CPU)
    cuda_policy = type(policy)(**{**policy.__dict__, "device_type": "cuda"})
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="disabled the loss scaler"):
        build_grad_scaler(cuda_policy)


def test_autocast_runs_the_policy_dtype():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with resolve_precision(precision(name), CPU).autocast():
            assert (a @ b).dtype == dtype, name


def test_tf32_flags_are_set_and_reported():
    try:
        off = apply_tf32(False)
        assert (
            off["allow_tf32"] is False
            and off["cuda_matmul"] == "ieee"
            and off["cudnn_conv"] == "ieee"
        )
        on = apply_tf32(True)
        assert on["cuda_matmul"] == "tf32" and on["cudnn_conv"] == "tf32"
    finally:
        apply_tf32(False)


def test_restored_tf32_undoes_a_tf32_opt_in():
    """tests/e2e/test_gpu.py's fixture: after a run that turned TF32 on, the flags read as before,
    so a later FP32 reference (the FP8 and block GEMM comparisons) is not computed in TF32."""
    matmul = torch.backends.cuda.matmul
    before = (
        legacy_tf32_getters(),
        matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
    )
    with restored_tf32():
        apply_tf32(True)
        assert matmul.fp32_precision == "tf32" and matmul.allow_tf32
    after = (legacy_tf32_getters(), matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    assert after == before and not matmul.allow_tf32


def legacy_tf32_getters() -> tuple:
    """What torch's legacy TF32 getters read; each raises when the new API was set alone."""
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def test_tf32_legacy_and_new_getters_read_alike_after_every_switch():
    """Torch internals and user code still read the legacy flags: after apply_tf32 they must
    not raise ("a mix of the legacy and new APIs") and must say what the new API says."""
    try:
        for allow in (True, False, True, False):
            flags = apply_tf32(allow)
            mode = "tf32" if allow else "ieee"
            assert legacy_tf32_getters() == (allow, allow, "high" if allow else "highest")
            assert flags["cuda_matmul"] == flags["cudnn_conv"] == mode, flags
            if flags["api"] == "fp32_precision":
                assert flags["cudnn_rnn"] == mode
                assert (
                    torch.backends.cuda.matmul.fp32_precision,
                    torch.backends.cudnn.conv.fp32_precision,
                    torch.backends.cudnn.rnn.fp32_precision,
                ) == (mode, mode, mode)
    finally:
        apply_tf32(False)


class CuBLASWithoutNewAPI(type(torch.backends.cuda.matmul)):
    """``torch.backends.cuda.matmul`` as torch before ~2.9 has it: no ``fp32_precision``."""

    def __getattr__(self, name):
        if name == "fp32_precision":
            raise AttributeError(name)
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name == "fp32_precision":
            raise AttributeError(name)
        super().__setattr__(name, value)


class NoSuchModule:
    """``torch.backends.cudnn.conv`` / ``.rnn`` before ~2.9: absent, any use is an error."""

    def __getattr__(self, name):
        raise AttributeError(name)

    def __setattr__(self, name, value):
        raise AttributeError(name)


def test_tf32_on_a_torch_without_the_fp32_precision_api_sets_only_the_legacy_flags(monkeypatch):
    """pyproject admits torch 2.6, which has neither ``fp32_precision`` nor its "ieee"."""
    monkeypatch.setattr(torch.backends.cuda, "matmul", CuBLASWithoutNewAPI())
    monkeypatch.setattr(torch.backends.cudnn, "conv", NoSuchModule())
    monkeypatch.setattr(torch.backends.cudnn, "rnn", NoSuchModule())
    try:
        for allow in (True, False):
            flags = apply_tf32(allow)
            assert flags["api"] == "allow_tf32", flags
            assert flags["cuda_matmul"] == flags["cudnn_conv"] == ("tf32" if allow else "ieee")
            assert legacy_tf32_getters() == (allow, allow, "high" if allow else "highest")
    finally:
        apply_tf32(False)
