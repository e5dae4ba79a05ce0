"""Quantized training of nn.Linear layers, every format in one package: FP8 with one scale per
tensor or per row, and the block-scaled formats MXFP8, NVFP4 and blockwise FP8. Real GEMMs where
the GPU has them, emulated elsewhere (the same quantization, FP32 matmuls: the numerics without
the speed-up; reports say "emulated").

What each module owns: ARCHITECTURE.md (``quant/`` in the layer table); the formats and their
settings: docs/precisions.md. tests/precision/test_*_torchao.py compare each format with torchao
bit for bit.
"""
