"""FP8 training for nn.Linear layers (modules: :mod:`.quant`, :mod:`.linear`, :mod:`.convert`, :mod:`.dist`): per-tensor scaled E4M3/E5M2 GEMMs, real or emulated.

The recipe follows Transformer Engine and torchao float8 training:

- Selected ``nn.Linear`` layers become :class:`Float8Linear`. Their three GEMMs (forward
  ``y = x Wᵀ``, backward ``dx = dy W`` and ``dW = dyᵀ x``) take FP8 operands, each with one scale per
  tensor, and accumulate in FP32. Activations and weights use E4M3 (max 448); gradients use E5M2
  (max 57344) in the ``hybrid`` format, or E4M3 everywhere in the ``e4m3`` format.
- Master weights, their gradients and the optimizer state stay FP32; the rest of the model runs
  under BF16 autocast.
- Scaling: ``dynamic`` ("current") scaling takes the scale from the tensor's absolute maximum at the
  moment of the cast; ``delayed`` scaling takes it from a history of earlier amax values (``max`` or
  ``most_recent`` of the history, divided by ``2**margin``). An amax that is zero or not finite
  gives no scale: the previous one is kept (as Transformer Engine does) and the cast is counted.
  Scales, amax histories, saturation and zero/non-finite amax counters are registered buffers:
  saved and restored with the model's state_dict.
- Power-of-two scales (``pow2_scales``, as torchao's ``round_scales_to_power_of_2``): every scale
  is rounded down to a power of two, so ``x * scale`` and the rescale of the product are exact and
  only the FP8 cast rounds; rounding down keeps ``amax * scale <= max`` (no new saturation), at the
  cost of up to one binade of the format's range.
- Layer selection (:func:`choose_layers`): every nn.Linear either converts or is kept in high
  precision with the reason (include/exclude patterns, first/last layer, the 16-alignment
  torch._scaled_mm needs, ``min_features``: layers too small to gain from FP8).

Two GEMM implementations share every layout and alignment rule (checked on every device, so code
that passes on the CPU cannot fail on the GPU because of a rule the CPU skipped):

- real: ``torch._scaled_mm`` on NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper);
- emulated: the same quantize -> FP8 cast happens, then the FP8 values (exact in FP32) are multiplied
  in FP32 and the product rescaled. Same numerics, no speed-up: reports label it "fp8 (emulated)".
"""
