"""mptrain: a mixed-precision training runner (FP32, FP16 + dynamic loss scaling, BF16, FP8) on Hydra.

The command line (``mptrain --help``) trains, sweeps, evaluates and samples. The Python API works
on what the runs leave behind (docs/python-api.md, docs/language-models.md):

- ``load_model(path, device="cpu", checkpoint="latest", trust_checkpoint_code=False)``: the
  trained model of a checkpoint file or run directory, in FP32 and eval mode, with the facts to
  feed it (``model.mptrain_preprocess``, ``mptrain_classes``; a language model's
  ``mptrain_vocabulary`` to encode and decode text).
- ``load_model_info(path, checkpoint="latest")``: those facts without building the model.
- ``preprocess(raw, spec, device="cpu")``: raw inputs to what a classifier was trained on.
- ``generate(model, prompt, max_new_tokens=..., temperature=..., top_k=..., seed=0)``: a
  language model's continuation of ``prompt``, as ``mptrain sample`` prints it.
- ``load_report(path)``: a run's report.json (the file or its run directory) as typed sections.

``import mptrain`` is cheap: each of these is imported (torch with it) on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__version__ = "0.1.0"

# The wheel ships the repository's conf/ and recipes/ as the subpackages mptrain.conf and
# mptrain.recipes (pyproject.toml's package-dir). Imported from a source checkout instead (the
# repository root on sys.path: `python -m mptrain` run there, or a checkout on PYTHONPATH), this
# package's directory has neither, so the checkout's root is searched for them as well.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "conf" / "__init__.py").is_file() and (_checkout / "recipes").is_dir():
    __path__.append(str(_checkout))

# The Python API, name -> (module, attribute), imported on first use: `import mptrain` stays cheap
# (no torch).
_LAZY = {
    "load_model": ("mptrain.commands.evaluate", "load_model"),
    "load_model_info": ("mptrain.commands.evaluate", "load_model_info"),
    "preprocess": ("mptrain.commands.evaluate", "preprocess"),
    "generate": ("mptrain.commands.sample", "generate_text"),
    "load_report": ("mptrain.report.schema", "load_report"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'mptrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
