"""The precision group's schemas (``precision=...``, ``precision.scaler.*``,
``precision.switch.*``, ``fp8.*``, and the block-scaled formats' ``mx.*`` and ``nvfp4.*``) and their
range rules; what each precision runs is :data:`mptrain.precision.policy.PRECISIONS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mptrain.config.base import (
    FP32_MAX,
    NOT_TRAINING,
    Accepts,
    ConfigError,
    at_least_rule,
    check_settings,
    in_range_rule,
    one_of_rule,
    require,
    setting,
)
from mptrain.config.format_table import GEMM_FORMATS

# --------------------------------------------------------------------------------------- precision
FP8_GRANULARITIES = ("tensorwise", "rowwise", "blockwise")
SCALE_ROUNDINGS = ("floor", "rceil")
REDUCE_DTYPES = ("float32", "float16", "bfloat16")
# precision.update's rules (mptrain.precision.update; nearest is torch's own step), and which
# pure precision takes which.
UPDATE_RULES = ("nearest", "stochastic", "kahan")
PURE_UPDATE_RULES = {"bf16_pure": UPDATE_RULES, "fp16_pure": ("nearest", "kahan")}
# fp8.min_features, mx.min_features, nvfp4.min_features
MIN_FEATURES = Accepts(
    lambda v: type(v) is int and v >= 0, "must be an integer >= 0 (0: every size converts)"
)
# precision.gemms.*: a GEMM's format
GEMM_FORMAT = Accepts(
    lambda v: v in GEMM_FORMATS,
    f"null (the precision's own) or one of {', '.join(GEMM_FORMATS)}",
    optional=True,
)


@dataclass
class ScalerConfig:
    """Dynamic loss scaling (torch.amp.GradScaler), for the precisions that scale (fp16)."""

    init_scale: float = setting(
        65536.0,
        "initial loss scale S (2^16)",
        accepts=Accepts(
            lambda v: 0 < v <= FP32_MAX,
            f"must be > 0 and at most FP32's largest value {FP32_MAX:.4g}",
        ),
    )
    growth_factor: float = setting(
        2.0,
        "S is multiplied by this after growth_interval clean steps",
        accepts=Accepts(lambda v: 1 < v < math.inf, "must be > 1 and finite"),
    )
    backoff_factor: float = setting(
        0.5,
        "S is multiplied by this when a step's gradients hold inf/NaN (step skipped)",
        accepts=Accepts(lambda v: 0 < v < 1, "must be in the open interval (0, 1)"),
    )
    growth_interval: int = setting(
        2000, "consecutive clean steps before S grows", accepts=at_least_rule(1)
    )


# The precisions without FP32 master weights (mptrain.precision.policy.PRECISIONS: param_dtype):
# a precision schedule switches only between precisions that keep FP32 master weights.
PURE_PRECISIONS = ("fp16_pure", "bf16_pure")
SWITCH_AT = Accepts(
    lambda v: math.isfinite(v) and (0 < v < 1 or (v >= 1 and v == int(v))),
    "a share of the run's optimizer steps in (0, 1), or a whole step number >= 1",
    optional=True,
)


@dataclass
class SwitchConfig:
    """A precision schedule (mptrain.train.switch): train in ``precision``, then in ``to`` from
    the step after ``at`` on. ``at`` below 1: a share of the run's optimizer steps, rounded to the
    nearest step (0.85 of 200: after step 170); 1 or more: the step number itself (a whole
    number). None (both): no switch."""

    to: str | None = setting(
        None, "the precision the run switches to (fp32, fp16, bf16, fp8, ...); null: no switch"
    )
    at: float | None = setting(
        None,
        "below 1: a share of the run's optimizer steps; 1 or more: the step it switches after",
        accepts=SWITCH_AT,
    )


@dataclass
class GemmsConfig:
    """The format of each GEMM of the converted Linear layers (mptrain.precision.quant.linear):
    null keeps the precision's own; ``bf16``/``fp32`` run that GEMM unquantized; another format of
    the table, of the precision's family (``fp8`` with FP8; ``mxfp8``, ``nvfp4``, ``fp8_blockwise``
    with a block-scaled precision), runs it in that format."""

    forward: str | None = setting(
        None, "the forward GEMM's format (y = x Wᵀ); null: the precision's own", accepts=GEMM_FORMAT
    )
    input_grad: str | None = setting(
        None,
        "the input gradient's format (dx = dy W): null, bf16, fp32 or a format of the family",
        accepts=GEMM_FORMAT,
    )
    weight_grad: str | None = setting(
        None,
        "the weight gradient's format (dW = dyᵀ x): null, bf16, fp32 or a format of the family",
        accepts=GEMM_FORMAT,
    )
    layers: list[str] = setting(
        help="the converted layers the formats above apply to (fnmatch); the rest keep their own",
        factory=lambda: ["*"],
        accepts=Accepts(bool, "at least one pattern ([*]: all)"),
    )


@dataclass
class PrecisionConfig:
    """A precision by name (what each runs: mptrain.precision.policy.PRECISIONS) and its tunables."""

    name: str = "auto"
    scaler: ScalerConfig = setting(
        help="the dynamic loss scaler: used where the loss is scaled (fp16; auto when it picks fp16)",
        factory=ScalerConfig,
    )
    allow_tf32: bool = setting(
        False, "TF32 for FP32 matmuls/convs on NVIDIA GPUs (ops outside autocast)"
    )
    switch: SwitchConfig = setting(
        help="a precision schedule: train in this precision, then in switch.to",
        factory=SwitchConfig,
    )
    # precision=auto only (mptrain.train.autoprecision; docs/precisions.md). Not a training
    # setting: what ran is recorded as the precision.
    measure: bool = setting(
        True,
        "time the candidates on this model before training (false: the device rule)",
        metadata=NOT_TRAINING,
    )
    update: str = setting(
        "nearest",
        "pure precisions: how an update reaches the low-precision weights: nearest | stochastic "
        "(bf16_pure) | kahan",
        accepts=one_of_rule(UPDATE_RULES, " or ".join(UPDATE_RULES)),
    )
    gemms: GemmsConfig = setting(
        help="a format per GEMM of the converted Linear layers (fp8, mxfp8, nvfp4)",
        factory=GemmsConfig,
    )
    alias: str | None = setting(
        None,
        "set by a Lightning name's option (16-mixed): the name requested",
        metadata=NOT_TRAINING,
    )


@dataclass
class FP8Config:
    format: str = setting(
        "hybrid",
        "hybrid: E4M3 activations/weights + E5M2 gradients | e4m3: E4M3 everywhere",
        accepts=one_of_rule(("hybrid", "e4m3"), "hybrid or e4m3"),
    )
    scaling: str = setting(
        "dynamic",
        "dynamic: scale from the tensor's amax at the cast | delayed: from the amax history",
        accepts=one_of_rule(("dynamic", "delayed"), "dynamic or delayed"),
    )
    granularity: str = setting(
        "tensorwise",
        (
            "tensorwise: one scale per tensor | rowwise: one per row of activations/gradients and"
            " per output (input, in the backward) feature of weights | blockwise: one per 1x128 "
            "tile of activations/gradients and per 128x128 block of weights (DeepSeek-V3); "
            "rowwise and blockwise: dynamic scaling only"
        ),
        accepts=one_of_rule(FP8_GRANULARITIES, "tensorwise, rowwise or blockwise"),
    )
    amax_history_len: int = setting(
        16, "delayed scaling: how many past amax values are kept", accepts=at_least_rule(1)
    )
    amax_compute_algo: str = setting(
        "max",
        "delayed scaling: max | most_recent of the history",
        accepts=one_of_rule(("max", "most_recent"), "max or most_recent"),
    )
    margin: int = setting(
        0,
        "the scale is divided by 2**margin (headroom for growing values)",
        accepts=at_least_rule(0),
    )
    pow2_scales: bool = setting(
        False,
        "round every scale down to a power of two: scaling itself adds no rounding error",
        accepts=Accepts(lambda v: isinstance(v, bool), "true or false"),
    )
    emulate: bool | None = setting(
        None,
        (
            "null: real FP8 GEMMs where the GPU has them (cc >= 8.9), emulated elsewhere; true: "
            "always emulate; false: require real FP8"
        ),
    )
    backend: str = setting(
        "builtin",
        "builtin (no extra dependency) | torchao (needs torchao and an FP8 GPU)",
        accepts=one_of_rule(("builtin", "torchao"), "builtin or torchao"),
    )
    keep_first_last: bool = setting(True, "keep the first and last Linear layers in BF16")
    include: list[str] = setting(
        help=(
            "module-name patterns (fnmatch) to convert, exactly (first/last too); empty = every "
            "aligned Linear"
        ),
        factory=list,
    )
    exclude: list[str] = setting(help="module-name patterns never converted", factory=list)
    min_features: int = setting(
        0,
        (
            "Linear layers with in_features or out_features below this stay in BF16 (too small to"
            " gain); 0: off"
        ),
        accepts=MIN_FEATURES,
    )


def validate_precision(p: PrecisionConfig) -> None:
    """The rules on the fields of ``precision`` and of its sections (the name is checked against
    the precision table at the CLI edge), then ``precision.update``: other than nearest only where
    the weights are low precision (a mixed precision's FP32 master weights take every update)."""
    check_settings(p, "precision.")
    for section in ("scaler", "switch", "gemms"):
        check_settings(getattr(p, section), f"precision.{section}.")
    if p.update == "nearest":
        return
    accepted = PURE_UPDATE_RULES.get(p.name)
    require(
        accepted is not None,
        "precision.update",
        p.update,
        f"only for pure low-precision weights (precision=bf16_pure or fp16_pure); "
        f"precision={p.name} keeps FP32 master weights, which take every update",
    )
    require(
        p.update in accepted,
        "precision.update",
        p.update,
        f"precision={p.name} accepts {' or '.join(accepted)} (the stochastic-rounding bit "
        "trick is BF16's)",
    )


def validate_switch(p: PrecisionConfig, known: tuple[str, ...]) -> None:
    """``precision.switch``: both keys or neither; ``to`` one of ``known`` (the precision names,
    auto excluded) with FP32 master weights, other than the run's (``at``'s own range is on its
    field). The run's own precision must be named (not auto) and keep FP32 master weights.
    Whether ``at`` falls inside the run is checked once its length is known."""
    to, at = p.switch.to, p.switch.at
    if to is None and at is None:
        return
    mixed = [n for n in known if n not in PURE_PRECISIONS]
    if to is None:
        raise ConfigError(
            f"precision.switch.to=None: to switch at={at:g}, name the precision: {', '.join(mixed)}"
        )
    require(at is not None, "precision.switch.at", at, f"when to switch to {to}: {SWITCH_AT.words}")
    pure = " (pure precisions keep no FP32 copy of the weights to switch with)"
    require(
        to in mixed,
        "precision.switch.to",
        to,
        f"a precision with FP32 master weights: {', '.join(mixed)}" + (pure if to in known else ""),
    )
    require(
        p.name in mixed,
        "precision",
        p.name,
        f"precision.switch.to={to} switches from a named precision with FP32 master weights: "
        f"{', '.join(mixed)}" + (pure if p.name in PURE_PRECISIONS else ""),
    )
    require(to != p.name, "precision.switch.to", to, f"the run already trains in {p.name}")


def validate_fp8(f: FP8Config) -> None:
    """The rules on the fields of ``fp8``, then those between them."""
    check_settings(f, "fp8.")
    require(
        f.granularity == "tensorwise" or f.scaling == "dynamic",
        "fp8.granularity",
        f.granularity,
        f"{f.granularity} scales are dynamic (one per row or block of each tensor, no history): "
        "use fp8.scaling=dynamic or fp8.granularity=tensorwise",
    )
    if f.granularity == "blockwise":
        require(
            f.backend == "builtin",
            "fp8.backend",
            f.backend,
            "fp8.granularity=blockwise runs on the builtin backend only (torchao's float8 training "
            "has no blockwise recipe); use fp8.backend=builtin",
        )
        require(
            not f.pow2_scales,
            "fp8.pow2_scales",
            f.pow2_scales,
            "fp8.granularity=blockwise takes each block's FP32 scale from its amax; "
            "use fp8.pow2_scales=false",
        )
    require(
        f.backend == "builtin" or f.scaling == "dynamic",
        "fp8.backend",
        f.backend,
        "torchao's float8 training scales dynamically only (no amax history): use "
        "fp8.scaling=dynamic, or fp8.backend=builtin for delayed scaling",
    )


# ------------------------------------------------------------------------- block-scaled formats
@dataclass
class BlockLayersConfig:
    """Which nn.Linear layers a block-scaled format converts: the rules of ``fp8.*``
    (mptrain.precision.selection), under the format's own keys (``mx.include``, ...)."""

    keep_first_last: bool = setting(True, "keep the first and last Linear layers in BF16")
    include: list[str] = setting(
        help=(
            "module-name patterns (fnmatch) to convert, exactly (first/last too); empty = every "
            "Linear whose sizes are multiples of the format's block (MXFP8: 32, NVFP4: 16)"
        ),
        factory=list,
    )
    exclude: list[str] = setting(help="module-name patterns never converted", factory=list)
    min_features: int = setting(
        0,
        "Linear layers with in_features or out_features below this stay in BF16; 0: off",
        accepts=MIN_FEATURES,
    )
    emulate: bool | None = setting(
        None,
        (
            "null: real GEMMs of the format where the GPU has them, emulated elsewhere; true: "
            "always emulate; false: require real ones"
        ),
    )


@dataclass
class MXConfig(BlockLayersConfig):
    scale_rounding: str = setting(
        "rceil",
        (
            "rceil: each block's scale is amax/448 rounded up to a power of two, nothing "
            "saturates (NVIDIA's cuBLAS/TE recipe, torchao's default) | floor: the OCP MX spec's "
            "floor(log2(amax)) - 8 (the largest elements of some blocks saturate)"
        ),
        accepts=one_of_rule(
            SCALE_ROUNDINGS,
            "rceil (amax / 448 rounded up to a power of two: nothing saturates) or floor (the OCP "
            "MX spec)",
        ),
    )


@dataclass
class NVFP4Config(BlockLayersConfig):
    weight_tiles: bool = setting(
        True,
        (
            "weights in 16x16 blocks: one quantized weight for the forward and the backward GEMM;"
            " false: 1x16 along each GEMM's reduction dimension"
        ),
    )
    hadamard: bool = setting(
        True,
        (
            "a random Hadamard transform (16x16, seeded signs) of both inputs of the "
            "weight-gradient GEMM, along the tokens"
        ),
    )
    stochastic_rounding: bool = setting(
        True,
        (
            "round the output gradients stochastically (seeded from `seed`, draws differing per "
            "DDP rank; every rank's generator states are checkpointed, so a resume is exact)"
        ),
    )
    keep_last_fraction: float = setting(
        0.15,
        (
            "this share of the transformer blocks, counted from the last and rounded up, stays in"
            " BF16 with every Linear after them (NVIDIA keeps the last ~15%); a model without a "
            "block list counts Linear layers, and says so"
        ),
        accepts=in_range_rule(
            "[0, 1)", "the share of transformer blocks, counted from the last, kept in BF16"
        ),
    )
