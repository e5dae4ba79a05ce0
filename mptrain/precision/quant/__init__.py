"""Quantized training of nn.Linear layers, every format in one package: FP8 with one scale per
tensor or per row (Transformer Engine's and torchao's float8 training), and the block-scaled
formats MXFP8, NVFP4 and blockwise FP8 (one scale per small block along a GEMM's reduction
dimension). Real GEMMs where the GPU has them, emulated elsewhere (the same quantization, FP32
matmuls: the numerics without the speed-up; reports say "emulated").

The layer and its GEMMs:

- :mod:`.linear`: the one quantized Linear (:class:`~.linear.QuantizedLinear`) and its one autograd
  function; a :class:`~.linear.GemmPlan` names the :class:`~.linear.GemmFormat` of each of its three
  GEMMs (forward, input gradient, weight gradient); :class:`~.linear.HighPrecisionGemm` runs one in
  BF16 or FP32;
- :mod:`.fp8_linear`: the FP8 formats (tensorwise, rowwise) and :class:`~.fp8_linear.Float8Linear`,
  the layer holding their per-role scalers; :mod:`.block_linear`: the block-scaled format
  (:class:`~.block_linear.BlockGemm`) and :class:`~.block_linear.BlockLinear`, holding its
  generator, Hadamard signs and counts;
- :mod:`.kernels`: the GEMM kernels both families call (``torch._scaled_mm`` and its block-scaled
  forms, their layout and alignment rules checked on every device, so code that passes on the CPU
  cannot fail on the GPU for a rule the CPU skipped) and which devices have them.

The quantizers:

- :mod:`.fp8`: FP8 scaling (:class:`~.fp8.FP8Quantization`; dynamic scaling from the tensor's amax,
  delayed scaling from an amax history; power-of-two scales) and the stateful per-role
  :class:`~.fp8.TensorScaler`;
- :mod:`.block_quant`: how each operand of each GEMM is quantized in a block format;
  :mod:`.mx` (MXFP8, MXFP4: blocks of 32, E8M0 scales), :mod:`.nvfp4` (E2M1 in blocks of 16,
  E4M3 block scales and an FP32 tensor scale, stochastic rounding), :mod:`.blockwise` (DeepSeek-V3's
  1x128 and 128x128 FP8 blocks), :mod:`.hadamard` (the random Hadamard transform of NVFP4's weight
  gradient), :mod:`.e2m1` (FP4 codes), :mod:`.blocked` (the layout and counts they share) and
  :mod:`.fake` (the fast fake quantization an emulated GEMM reads: the same bits, measured faster).

The run's side: :mod:`.convert` (which layers convert, one path for every format, and the
report's sections), :mod:`.torchao_bridge` (``fp8.backend=torchao``), :mod:`.dist` (what data-parallel ranks agree on for FP8).
tests/precision/test_*_torchao.py compare each format with torchao bit for bit.
"""
