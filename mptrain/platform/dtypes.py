"""Floating-point dtypes by the names configs and reports use ("float32", "bfloat16", ...)."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")
