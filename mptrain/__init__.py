"""mptrain: a mixed-precision training runner (FP32, FP16 + dynamic loss scaling, BF16, FP8) on Hydra."""

__version__ = "0.1.0"
