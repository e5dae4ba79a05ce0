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
