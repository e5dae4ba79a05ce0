"""A roofline estimate of one training step's time per precision on a named GPU: the least time
the step can take, from its GEMM shapes and the bytes it must move (:mod:`.gemms`) and the GPU's
dense peaks and bandwidth (:mod:`mptrain.perf.gpus`). Always a *prediction*, and a lower
bound: no efficiency factor is applied (a measured step is slower; its ratio to this one is the
figure worth recording).

The step's time is the sum of

- **each GEMM pass** (forward; backward for the data gradient where its input needs one; for
  the weight gradient): ``max(FLOPs / peak of its format, bytes / bandwidth)``, with bytes = each
  operand read once in the format's size (block-scaled formats: with its scales) and the result
  written once (FP8 and block-scaled GEMMs write BF16).
  A fused attention is one pass forward and one backward (twice the forward's FLOPs; the causal
  mask halves both: flash kernels skip the masked blocks);
- **casts**, memory-bound: autocast's copies of FP32 operands into the GEMM's format and of
  their gradients back (a read and a write each); FP8's quantization of each operand of every
  FP8 GEMM, input, weight and output gradient: an amax pass (a read) and the cast (a read and a
  one-byte write), with tensorwise scales the FP8 copies transposed for the backward GEMMs (a
  byte read and written), with rowwise scales every operand quantized again along its other
  axis instead; weight gradients accumulated into their FP32 master copies; the block-scaled
  formats' quantization, each GEMM quantizing its two operands along its own reduction dimension
  (:func:`block_cast_bytes`);
- **the other operations** (norms, activations, residuals, pooling, the loss): the forward's
  bytes moved, three times (assumed: the backward reads the output gradient and what the forward
  saved, and writes the input gradient: twice the forward's traffic);
- **the optimizer step**: passes over every parameter at the parameters' size
  (:data:`OPTIMIZER_PASSES`; gradient clipping and loss-scale unscaling add theirs).

A per-GEMM plan (``precision.gemms``: :attr:`Arithmetic.plan` for the converted Linears it names,
:attr:`Arithmetic.planned`) prices each of those Linears' three GEMMs in its own format
(:func:`planned_passes`: a BF16 weight gradient at the BF16 peak, an MXFP8 one of an NVFP4 layer at
MXFP8's) and their casts GEMM by GEMM (:func:`planned_cast_bytes`).

Model FLOPs (what MFU counts) are three times the forward GEMM FLOPs, attention whole (PaLM,
appendix B); MFU's peak is the FLOP-weighted one of the formats the GEMMs ran in
(:func:`mptrain.perf.gpus.mixed_peak_flops`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from mptrain.config.format_table import BLOCK_FORMATS, FORMAT_TABLE, FP8, FP8_BLOCKWISE, NVFP4
from mptrain.perf.gemms import ATTENTION, LINEAR, Accounting, Gemm
from mptrain.perf.gpus import GPU, mixed_peak_flops
from mptrain.precision import formats
from mptrain.precision.policy import PRECISIONS

# Bytes per element of a GEMM operand, and of its result (FP8 and block-scaled GEMMs write BF16),
# from the format table (NVFP4: two E2M1 codes a byte).
FORMAT_BYTES = {name: row.element_bytes for name, row in FORMAT_TABLE.items()}
RESULT_BYTES = {name: row.result_bytes for name, row in FORMAT_TABLE.items()}
# The formats a precision converts Linears to (the rest of its GEMMs run in its GEMM format).
LAYER_FORMATS = tuple(formats.LAYER_FORMATS)
# Block scales, bytes per element: (a 1-D block along the reduction dimension, a 2-D weight
# tile), and bytes per tensor (the format table's rows: MXFP8 one E8M0 byte per 32; NVFP4 one
# E4M3 byte per 16, 16x16 weight tiles per 256, and an FP32 scale per tensor; blockwise FP8 an
# FP32 scale per 1x128 tile of activations and gradients, per 128x128 block of weights).
SCALE_BYTES = {name: FORMAT_TABLE[name].scale_bytes for name in BLOCK_FORMATS}
TENSOR_SCALE_BYTES = {
    name: row.tensor_scale_bytes for name, row in FORMAT_TABLE.items() if row.tensor_scale_bytes
}
_LOW_FORMAT = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Passes over every parameter per optimizer step: AdamW reads the parameter, its gradient and
# both moments and writes the parameter and the moments; SGD with momentum reads the parameter,
# gradient and buffer and writes the parameter and buffer (without momentum: 2 reads, 1 write).
OPTIMIZER_PASSES = {"adamw": 7, "sgd": 5, "sgd_no_momentum": 3}
CLIP_PASSES = 3  # the gradients' norm (a read), then their scaling (a read and a write)
UNSCALE_PASSES = 2  # GradScaler.unscale_: a read and a write of every gradient
# Not in the step time: the least a CUDA kernel costs (its launch and the smallest kernel: a few
# microseconds on any NVIDIA GPU). A predicted step shorter than its kernels x this is launch-bound.
KERNEL_FLOOR_S = 5e-6


@dataclass(frozen=True)
class Arithmetic:
    """What the roofline needs of a precision: the GEMMs' format, the autocast the meta pass
    emulates, the bytes of a parameter (and of its gradient and optimizer state), which Linears
    run in a low-precision format (``layer_format``) and how they are scaled."""

    precision: str
    gemm_format: str  # fp32 | tf32 | bf16 | fp16: every GEMM not converted
    autocast: torch.dtype | None
    param_dtype: torch.dtype
    layers: frozenset[str] = frozenset()  # the Linears converted to layer_format
    layer_format: str = "fp8"  # one of LAYER_FORMATS
    rowwise: bool = False  # FP8 scales per row: every operand quantized twice
    loss_scaling: bool = False
    weight_tiles: bool = False  # NVFP4's 16x16 weight tiles (blockwise FP8's 128x128: always)
    # precision.gemms: the formats of the forward, input- and weight-gradient GEMMs of the
    # converted Linears in ``planned``; None: all three in layer_format
    plan: tuple[str, str, str] | None = None
    planned: frozenset[str] = frozenset()

    @property
    def param_bytes(self) -> int:
        return torch.tensor([], dtype=self.param_dtype).element_size()

    def tiled(self, fmt: str) -> bool:
        """A weight quantized to ``fmt`` is in 2-D tiles (blockwise FP8's 128x128; NVFP4's 16x16
        with ``weight_tiles``): one quantization serves the forward and data-gradient GEMMs."""
        return fmt == FP8_BLOCKWISE or (fmt == NVFP4 and self.weight_tiles)

    @property
    def tiled_weight(self) -> bool:
        """One 2-D quantization of the weight serves the forward and the data-gradient GEMM."""
        return self.tiled(self.layer_format)


def arithmetic_for(
    precision: str,
    layers: Iterable[str] = (),
    granularity: str = "tensorwise",
    weight_tiles: bool = True,
    plan: tuple[str, str, str] | None = None,
    planned: Iterable[str] = (),
) -> Arithmetic:
    """The :class:`Arithmetic` of ``precision`` (a name of :data:`~mptrain.precision.policy.PRECISIONS`
    or ``tf32``: FP32 with TF32 GEMMs), read from the precision table; ``layers``: the Linears
    precision=fp8, mxfp8 or nvfp4 converts (its layer choice), ignored by the others;
    ``granularity``: FP8's scaling (``blockwise``: the blockwise FP8 format); ``weight_tiles``:
    NVFP4's 16x16 weight tiles; ``plan``: the formats of the forward, data- and weight-gradient
    GEMMs of the converted Linears in ``planned`` (``precision.gemms``), ignored without a layer
    format."""
    if precision == "tf32":
        return Arithmetic("tf32", "tf32", None, torch.float32)
    spec = PRECISIONS.get(precision)
    if spec is None:
        raise ValueError(f"precision {precision!r}: one of tf32, {', '.join(PRECISIONS)}")
    low = spec.autocast_dtype or (None if spec.param_dtype == torch.float32 else spec.param_dtype)
    fmt = formats.layer_format(precision, granularity)
    if fmt is None:
        plan = None
    return Arithmetic(
        precision=precision,
        gemm_format=_LOW_FORMAT[low],
        autocast=spec.autocast_dtype,
        param_dtype=spec.param_dtype,
        layers=frozenset(layers) if fmt is not None else frozenset(),
        layer_format=fmt or "fp8",
        rowwise=precision == "fp8" and granularity == "rowwise",
        loss_scaling=spec.loss_scaling,
        weight_tiles=(precision == NVFP4 or NVFP4 in (plan or ())) and weight_tiles,
        plan=plan,
        planned=frozenset(planned) if plan is not None else frozenset(),
    )


def gemm_format(g: Gemm, arithmetic: Arithmetic) -> str:
    """The format ``g`` runs in: the arithmetic's layer format for the Linears its layer choice
    converted, else the precision's GEMM format."""
    return (
        arithmetic.layer_format
        if g.kind == LINEAR and g.name in arithmetic.layers
        else arithmetic.gemm_format
    )


def gemm_formats(g: Gemm, arithmetic: Arithmetic) -> tuple[str, str, str]:
    """The formats of ``g``'s forward, data-gradient and weight-gradient GEMMs: the arithmetic's
    plan for a converted Linear it names, else :func:`gemm_format` for all three."""
    converted = g.kind == LINEAR and g.name in arithmetic.layers
    if arithmetic.plan is not None and converted and g.name in arithmetic.planned:
        return arithmetic.plan
    fmt = gemm_format(g, arithmetic)
    return fmt, fmt, fmt


# ------------------------------------------------------------------------------ per GEMM
def operand_bytes(fmt: str, elems: float, tile: bool = False) -> float:
    """Bytes of a GEMM operand of ``elems`` elements in ``fmt``: its elements and, for a
    block-scaled format, its block scales (``tile``: a weight in 2-D tiles) and tensor scale."""
    scales = SCALE_BYTES.get(fmt, (0.0, 0.0))[1 if tile else 0]
    return elems * (FORMAT_BYTES[fmt] + scales) + TENSOR_SCALE_BYTES.get(fmt, 0)


def gemm_passes(
    g: Gemm, fmt: str, batch: int, tiled_weight: bool = False
) -> list[tuple[float, float]]:
    """(FLOPs executed, bytes moved) of each pass of ``g`` over ``batch`` samples in ``fmt``:
    forward, data gradient (if A needs one), weight gradient (if B needs one); a fused attention:
    forward and one backward. Operands are read with their scales (:func:`operand_bytes`;
    ``tiled_weight``: the weight's in 2-D tiles)."""
    ob, rb = FORMAT_BYTES[fmt], RESULT_BYTES[fmt]
    a, c = g.a_elems * batch, g.out_elems * batch
    b = g.b_elems if g.b_is_weight else g.b_elems * batch
    flops = g.flops * batch * (0.5 if g.causal else 1.0)
    x, dy = operand_bytes(fmt, a), operand_bytes(fmt, c)
    w = operand_bytes(fmt, b, tiled_weight and g.b_is_weight)
    passes = [(flops, x + w + c * rb)]
    if g.kind == ATTENTION:
        if g.a_grad or g.b_grad:  # reads Q, K, V, O, dO; writes dQ, dK, dV
            passes.append((2 * flops, (a + b) * (ob + rb) + 2 * c * ob))
        return passes
    if g.a_grad:
        passes.append((flops, dy + w + a * rb))
    if g.b_grad:
        passes.append((flops, dy + x + b * rb))
    return passes


def pass_seconds(flops: float, nbytes: float, fmt: str, gpu: GPU) -> float:
    """The roofline of one pass: the longer of its FLOPs at the format's peak and its bytes at
    the memory bandwidth."""
    return max(flops / gpu.peak_flops(fmt), nbytes / gpu.bandwidth_bytes_s)


def cast_bytes(g: Gemm, fmt: str, arithmetic: Arithmetic, batch: int) -> float:
    """Bytes the casts around ``g`` move over ``batch`` samples (see the module doc)."""
    a = g.a_elems * batch
    b = g.b_elems if g.b_is_weight else g.b_elems * batch
    if fmt == "fp8":
        return _fp8_cast_bytes(g, arithmetic, a, b, g.out_elems * batch)
    if fmt in SCALE_BYTES:
        return block_cast_bytes(g, arithmetic, a, b, g.out_elems * batch)
    low = FORMAT_BYTES[fmt]
    total = 0.0
    for elems, arrived, grad in ((a, g.a_bytes, g.a_grad), (b, g.b_bytes, g.b_grad)):
        if arrived > low:  # cast down for the GEMM, and (autograd) its gradient cast back up
            total += elems * (arrived + low) * (2 if grad else 1)
    return total


def _fp8_cast_bytes(g: Gemm, arithmetic: Arithmetic, x: float, w: float, dy: float) -> float:
    """Quantization of an FP8 Linear's input ``x``, weight ``w`` and output gradient ``dy``
    (element counts): amax read, then read and a one-byte write, once per scale axis."""

    def quantize(elems: float, high: int) -> float:
        return elems * (2 * high + 1)

    dy_bytes = RESULT_BYTES["fp8"]  # the output gradient arrives in the output's BF16
    times = 2 if arithmetic.rowwise else 1
    total = times * (quantize(x, g.a_bytes) + quantize(w, g.b_bytes) + quantize(dy, dy_bytes))
    if not arithmetic.rowwise:
        total += 2 * (x + w + dy)  # the FP8 copies transposed for the backward GEMMs
    return total + _gradient_casts(g, x, w)


def _gradient_casts(g: Gemm, x: float, w: float) -> float:
    """A low-precision Linear's BF16 gradients cast to the operands' dtypes: dW written in BF16
    and added into the FP32 gradient, dX back to the input's dtype (read and write each)."""
    low, total = RESULT_BYTES["fp8"], 0.0
    if g.b_grad and g.b_bytes > low:
        total += w * (low + g.b_bytes)
    if g.a_grad and g.a_bytes > low:
        total += x * (low + g.a_bytes)
    return total


def block_cast_bytes(g: Gemm, arithmetic: Arithmetic, x: float, w: float, dy: float) -> float:
    """Quantization of a block-scaled Linear's input ``x``, weight ``w`` and output gradient
    ``dy`` (element counts), once per GEMM that reads each along its reduction dimension: the
    forward reads x and W, the data gradient dy and W (if the input needs one), the weight
    gradient dy and x (if the weight needs one); W once where one 2-D tiling serves both its GEMMs
    (128x128 blockwise, NVFP4's 16x16). Each quantization reads the high-precision operand and
    writes its elements and scales (:func:`operand_bytes`; a block's scale comes from the block:
    no amax pass); NVFP4's per-tensor scale first reads it for its amax, as FP8's tensorwise
    scale does."""
    fmt = arithmetic.layer_format
    amax = 1 if fmt in TENSOR_SCALE_BYTES else 0  # the per-tensor scale's amax pass: a read
    dy_bytes = RESULT_BYTES[fmt]  # the output gradient arrives in the output's BF16

    def quantize(elems: float, high: float, times: int, tile: bool = False) -> float:
        return times * (elems * high * (1 + amax) + operand_bytes(fmt, elems, tile))

    w_times = 1 if arithmetic.tiled_weight or not g.a_grad else 2
    total = quantize(x, g.a_bytes, 1 + g.b_grad) + quantize(
        w, g.b_bytes, w_times, arithmetic.tiled_weight
    )
    total += quantize(dy, dy_bytes, g.a_grad + g.b_grad)
    return total + _gradient_casts(g, x, w)


# ------------------------------------------------------------------------------ per-GEMM plans
def _present(g: Gemm) -> list[int]:
    """The GEMMs of Linear ``g`` that run, by index into (forward, data gradient, weight
    gradient): the forward, the data gradient where its input needs one, the weight gradient
    where its weight does."""
    return [0, *([1] if g.a_grad else []), *([2] if g.b_grad else [])]


def planned_passes(
    g: Gemm, fmts: tuple[str, str, str], arithmetic: Arithmetic, batch: int
) -> list[tuple[str, float, float]]:
    """(format, FLOPs, bytes) of each pass of Linear ``g`` whose forward, data-gradient and
    weight-gradient GEMMs run in ``fmts``: each priced as :func:`gemm_passes` prices it in its
    own format."""
    present = _present(g)
    return [
        (fmts[i], *gemm_passes(g, fmts[i], batch, arithmetic.tiled(fmts[i]))[k])
        for k, i in enumerate(present)
    ]


def planned_cast_bytes(
    g: Gemm, fmts: tuple[str, str, str], arithmetic: Arithmetic, batch: int
) -> float:
    """Bytes the casts around Linear ``g`` move over ``batch`` samples when its forward,
    data-gradient and weight-gradient GEMMs run in ``fmts``, GEMM by GEMM: each of x, W and dy
    quantized for the GEMMs of each quantized format that read it (:func:`_operand_casts`) and
    cast for the high-precision ones (a weight from FP32 each time: no autocast cache), each
    gradient cast from its GEMM's result to its operand's dtype."""
    x, w, dy = g.a_elems * batch, g.b_elems, g.out_elems * batch
    operands = {  # each tensor: elements, bytes as it arrives, the GEMMs (indices) reading it
        "x": (x, g.a_bytes, (0, 2)),
        "w": (w, g.b_bytes, (0, 1)),
        "dy": (dy, RESULT_BYTES[arithmetic.layer_format], (1, 2)),  # in the output's dtype
    }
    present, total = _present(g), 0.0
    for name, (elems, high, gemms) in operands.items():
        readers = [fmts[i] for i in gemms if i in present]
        for fmt, n in Counter(readers).items():
            total += _operand_casts(fmt, n, elems, high, arithmetic, name == "w")
    for i, elems, arrived in ((1, x, g.a_bytes), (2, w, g.b_bytes)):  # the gradients, cast back
        result = RESULT_BYTES[fmts[i]]
        if i in present and arrived != result:
            total += elems * (result + arrived)
    return total


def _operand_casts(
    fmt: str, n: int, elems: float, high: float, arithmetic: Arithmetic, weight: bool
) -> float:
    """Bytes moved making an operand of ``elems`` elements, arrived in ``high`` bytes each, ready
    for the ``n`` GEMMs of format ``fmt`` that read it (``weight``: it is the weight)."""
    if fmt == FP8:  # amax read, read and one-byte write; tensorwise: a transposed copy for two
        once = elems * (2 * high + 1)
        return n * once if arithmetic.rowwise else once + (2 * elems if n == 2 else 0)
    if fmt in SCALE_BYTES:  # per GEMM along its reduction dimension; a 2-D weight tile once
        tile = weight and arithmetic.tiled(fmt)
        amax = 1 if fmt in TENSOR_SCALE_BYTES else 0
        times = 1 if tile else n
        return times * (elems * high * (1 + amax) + operand_bytes(fmt, elems, tile))
    low = FORMAT_BYTES[fmt]  # BF16 or FP32: a cast per GEMM where the dtype differs
    return n * elems * (high + low) if high != low else 0.0


# ------------------------------------------------------------------------------ one step
@dataclass(frozen=True)
class Step:
    """What one optimizer step trains on one GPU: ``batch`` samples per micro-batch,
    ``micro_batches`` of them, ``tokens_per_sample`` (language models), and the optimizer's
    passes over the parameters (:func:`optimizer_passes`; a GPU holding a shard of them, as
    under FSDP, makes its share of those passes: a fraction)."""

    batch: int
    optimizer_passes: float
    micro_batches: int = 1
    tokens_per_sample: int | None = None


def optimizer_passes(name: str, momentum: float = 0.0, clip: bool = False) -> int:
    """Passes over every parameter per step for optimizer ``name`` (adamw | sgd), with gradient
    clipping (``clip``) adding its own; loss-scale unscaling is the precision's (:func:`predict`)."""
    key = "sgd_no_momentum" if name == "sgd" and not momentum else name
    if key not in OPTIMIZER_PASSES:
        raise ValueError(f"optimizer {name!r}: the roofline knows adamw and sgd")
    return OPTIMIZER_PASSES[key] + (CLIP_PASSES if clip else 0)


@dataclass(frozen=True)
class Prediction:
    """One precision's predicted step on one GPU (seconds, at best), its parts, and the model
    FLOPs by format MFU's peak is weighted by."""

    precision: str
    gpu: str
    batch: int  # samples per optimizer step
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    gemm_s: float
    compute_bound_share: float  # of the GEMM time, in passes bound by FLOPs rather than bytes
    cast_s: float
    elementwise_s: float
    optimizer_s: float
    model_flops: float  # per step: 3 x forward GEMM FLOPs, attention whole
    flops_by_format: dict[str, float] = field(default_factory=dict)
    mixed_peak_tflops: float = 0.0  # the FLOP-weighted peak of flops_by_format
    kernels: int = 0  # per step, about: each forward operation, and twice that for the backward

    @property
    def launch_bound(self) -> bool:
        """The step is shorter than its kernels at :data:`KERNEL_FLOOR_S` each: on a real GPU
        launches, not FLOPs or bytes, set its time (the roofline does not count them)."""
        return self.step_time_s < self.kernels * KERNEL_FLOOR_S

    @property
    def low_share(self) -> float:
        """The share of model FLOPs in the converted Linears' format (FP8, blockwise FP8, MXFP8
        or NVFP4)."""
        low = sum(self.flops_by_format.get(f, 0.0) for f in LAYER_FORMATS)
        return low / self.model_flops if self.model_flops else 0.0


def model_flops_by_format(accounting: Accounting, arithmetic: Arithmetic) -> dict[str, float]:
    """Model FLOPs per sample (3 x forward, attention whole) by the format each GEMM runs in."""
    out: dict[str, float] = {}
    for g in accounting.gemms:
        for fmt, n in Counter(gemm_formats(g, arithmetic)).items():
            out[fmt] = out.get(fmt, 0.0) + n * g.flops
    return out


def _micro_batch(acc: Accounting, arithmetic: Arithmetic, gpu: GPU, batch: int) -> dict[str, float]:
    """Seconds of one micro-batch's forward and backward: GEMMs (and how much of that is
    compute-bound), casts, other operations."""
    gemm = bound = casts = 0.0
    for g in acc.gemms:
        own, fmts = gemm_format(g, arithmetic), gemm_formats(g, arithmetic)
        if fmts == (own, own, own):
            passes = [(own, *p) for p in gemm_passes(g, own, batch, arithmetic.tiled_weight)]
            casts += cast_bytes(g, own, arithmetic, batch)
        else:  # a per-GEMM plan's Linear
            passes = planned_passes(g, fmts, arithmetic, batch)
            casts += planned_cast_bytes(g, fmts, arithmetic, batch)
        for fmt, flops, nbytes in passes:
            seconds = pass_seconds(flops, nbytes, fmt, gpu)
            gemm += seconds
            if flops / gpu.peak_flops(fmt) >= nbytes / gpu.bandwidth_bytes_s:
                bound += seconds
    bandwidth = gpu.bandwidth_bytes_s
    return {
        "gemm": gemm,
        "bound": bound,
        "casts": casts / bandwidth,
        "elementwise": 3 * acc.elementwise_bytes * batch / bandwidth,
    }


def predict(acc: Accounting, arithmetic: Arithmetic, gpu: GPU, step: Step) -> Prediction:
    """The roofline of one optimizer step (see module doc) of ``acc`` (accounted under
    ``arithmetic.autocast``) in ``arithmetic`` on ``gpu``. ValueError when the GPU lacks a format."""
    micro = _micro_batch(acc, arithmetic, gpu, step.batch)
    passes = step.optimizer_passes + (UNSCALE_PASSES if arithmetic.loss_scaling else 0)
    optimizer_s = acc.parameters * arithmetic.param_bytes * passes / gpu.bandwidth_bytes_s
    k = step.micro_batches
    step_s = k * (micro["gemm"] + micro["casts"] + micro["elementwise"]) + optimizer_s
    samples = step.batch * k
    by_format = {f: v * samples for f, v in model_flops_by_format(acc, arithmetic).items()}
    model_flops = sum(by_format.values())
    return Prediction(
        precision=arithmetic.precision,
        gpu=gpu.key,
        batch=samples,
        step_time_s=step_s,
        samples_per_s=samples / step_s,
        tokens_per_s=samples * step.tokens_per_sample / step_s if step.tokens_per_sample else None,
        gemm_s=k * micro["gemm"],
        compute_bound_share=micro["bound"] / micro["gemm"] if micro["gemm"] else 0.0,
        cast_s=k * micro["casts"],
        elementwise_s=k * micro["elementwise"],
        optimizer_s=optimizer_s,
        model_flops=model_flops,
        flops_by_format=by_format,
        mixed_peak_tflops=mixed_peak_flops(by_format, gpu) / 1e12,
        kernels=3 * k * (len(acc.gemms) + sum(acc.elementwise_ops.values())),
    )
