"""mptrain: a mixed-precision training runner (FP32, FP16 + dynamic loss scaling, BF16, FP8) on Hydra."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# The wheel ships the repository's conf/ and recipes/ as the subpackages mptrain.conf and
# mptrain.recipes (pyproject.toml's package-dir). Imported from a source checkout instead (the
# repository root on sys.path: `python -m mptrain` run there, or a checkout on PYTHONPATH), this
# package's directory has neither, so the checkout's root is searched for them as well.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "conf" / "__init__.py").is_file() and (_checkout / "recipes").is_dir():
    __path__.append(str(_checkout))

# The Python API for trained models, imported on first use: `import mptrain` stays cheap (no torch).
_LAZY = {"load_model", "load_model_info", "preprocess"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from mptrain.commands import evaluate as evaluation

        return getattr(evaluation, name)
    raise AttributeError(f"module 'mptrain' has no attribute {name!r}")
