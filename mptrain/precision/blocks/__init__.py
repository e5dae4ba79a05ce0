"""Block-scaled low-precision formats, quantized exactly on any device (the numerics of the
hardware GEMMs' operands, emulated: no speed-up): one scale per small block of elements along a
GEMM's reduction dimension instead of one per tensor or row.

- :mod:`.mx`: MXFP8 (E4M3/E5M2) and MXFP4 (E2M1), blocks of 32, E8M0 scales rounded ``floor``
  (OCP MX v1.0) or ``rceil`` (NVIDIA cuBLAS);
- :mod:`.nvfp4`: NVFP4, E2M1 in blocks of 16 (or 16x16 weight tiles), E4M3 block scales and an
  FP32 per-tensor scale, stochastic rounding from a seeded generator (arXiv 2509.25149);
- :mod:`.hadamard`: the random Hadamard transform NVFP4 training applies to the weight-gradient
  GEMM's inputs;
- :mod:`.blockwise`: blockwise FP8, 1x128 tiles and 128x128 weight blocks with FP32 scales
  (DeepSeek-V3, arXiv 2412.19437);
- :mod:`.blocked`: what they share: the layout, :class:`~.blocked.BlockQuantized` (elements,
  scales, ``dequantize()``) and the per-tensor counts :class:`~.blocked.BlockStats` (saturated,
  underflowed to zero, zero blocks, non-finite blocks);
- :mod:`.e2m1`: the FP4 element format, encoded by hand and packed two per byte.

Each format has ``quantize_<format>(x, dim, **settings) -> BlockQuantized`` and
``fake_quant_<format>(x, dim, **settings) -> Tensor`` (the dequantized operand, in ``x``'s dtype:
what an emulated GEMM multiplies), with ``dim`` the GEMM's reduction dimension of ``x``: one call
per operand of each GEMM, so the backward re-quantizes its saved high-precision tensors along
its own reduction dimensions. tests/precision/test_blocks_torchao.py compares elements and
scales with torchao 0.18 bit for bit.
"""
