"""The mptrain internals the benchmarks use, in one place: when mptrain is restructured, this is
the file to fix (``python -m benchmarks.mptrain_api`` imports every name and says which moved).

mptrain's public API (docs/python-api.md: ``mptrain.load_model``, ``load_report``, the command
line) works on what runs leave behind; the benchmarks measure the parts of a run, so they need
what lies below it. Each name here is ``name -> (module, attribute)`` (``None``: the module
itself), imported on first use as in ``mptrain/__init__.py``, so a script pays only for what it
uses (``startup.py`` and ``gpu_all.py`` import none of it). Why the benchmarks need each group:

- composing a run (:func:`compose`): the benchmarks build the RunConfig ``mptrain OVERRIDES``
  would train, through the CLI's own Hydra composition, then train or time it;
- training and timing: ``train`` (a whole job, report included), ``prepare_run`` with
  ``train_loop``/``LoopHooks`` (the loop itself, stopped by a hook: gpu_speed.py, overhead.py),
  ``measure``/``run_figures``/``precision_config`` (what ``mptrain bench`` times and reports);
- the FP8 and block-scaled formats (precision.quant, config.format_table): the SQNR and GEMM
  benchmarks measure these functions themselves;
- the data path (data.*): data_path.py times the pipelines piece by piece;
- the performance model (perf.*): the roofline, the GPU peak table and FLOP counts behind MFU;
- the hardware facts every JSON document records (platform.hardware, platform.contention).
"""

from __future__ import annotations

import importlib
from typing import Any

# The advise predictor gpu_speed.py records next to each measurement when mptrain has it.
PREDICTOR = "mptrain.commands.advise.predict"

_INTERNALS: dict[str, tuple[str, str | None]] = {
    # composing and training a run
    "ConfigError": ("mptrain.config.base", "ConfigError"),
    "RunConfig": ("mptrain.config.run", "RunConfig"),
    "train": ("mptrain.train.job", "train"),
    "prepare_run": ("mptrain.train.build", "prepare_run"),
    "account_step": ("mptrain.train.memory", "account_step"),
    # what fits a GPU (advise's memory part): the line through two accounted steps, the states
    "fits": ("mptrain.commands.advise.fits", None),
    "footprint": ("mptrain.commands.advise.footprint", None),
    # advise's equivalence verdict over seeds (state_dtype_tost.py)
    "advise_verdict": ("mptrain.commands.advise.confidence", "verdict"),
    "verdict_words": ("mptrain.commands.advise.confidence", "verdict_words"),
    "train_loop": ("mptrain.train.loop", "train_loop"),
    "LoopHooks": ("mptrain.train.loop", "LoopHooks"),
    "MetricsLog": ("mptrain.output.metrics", "MetricsLog"),
    "measure": ("mptrain.commands.bench", "measure"),
    "run_figures": ("mptrain.commands.bench", "run_figures"),
    "precision_config": ("mptrain.commands.bench", "precision_config"),
    "compile_counts": ("mptrain.models.build", "compile_counts"),
    # models
    "gpt_model": ("mptrain.models.gpt", None),
    "GPT": ("mptrain.models.gpt", "GPT"),
    "GPTShape": ("mptrain.models.gpt", "GPTShape"),
    "MLPConfig": ("mptrain.config.models", "MLPConfig"),
    "build_mlp": ("mptrain.models.builtin", "build_mlp"),
    # FP8 and block-scaled formats
    "FORMAT_TABLE": ("mptrain.config.format_table", "FORMAT_TABLE"),
    "TABLE_BLOCK_FORMATS": ("mptrain.config.format_table", "BLOCK_FORMATS"),
    "E4M3": ("mptrain.precision.quant.fp8", "E4M3"),
    "E5M2": ("mptrain.precision.quant.fp8", "E5M2"),
    "FP8Quantization": ("mptrain.precision.quant.fp8", "FP8Quantization"),
    "quantize": ("mptrain.precision.quant.fp8", "quantize"),
    "scale_from_amax": ("mptrain.precision.quant.fp8", "scale_from_amax"),
    "Float8Linear": ("mptrain.precision.quant.fp8_linear", "Float8Linear"),
    "BlockQuantization": ("mptrain.precision.quant.block_quant", "BlockQuantization"),
    "quantize_operand": ("mptrain.precision.quant.block_quant", "quantize_operand"),
    "fake_quant_operand": ("mptrain.precision.quant.block_quant", "fake_quant_operand"),
    "BlockLinear": ("mptrain.precision.quant.block_linear", "BlockLinear"),
    "fake_quant_blockwise": ("mptrain.precision.quant.blockwise", "fake_quant_blockwise"),
    "fake_quant_mx": ("mptrain.precision.quant.mx", "fake_quant_mx"),
    "fake_quant_nvfp4": ("mptrain.precision.quant.nvfp4", "fake_quant_nvfp4"),
    "random_hadamard_transform": ("mptrain.precision.quant.hadamard", "random_hadamard_transform"),
    "rht_signs": ("mptrain.precision.quant.hadamard", "rht_signs"),
    "apply_quantized": ("mptrain.precision.quant.convert", "apply_quantized"),
    "layer_rules": ("mptrain.precision.quant.convert", "layer_rules"),
    "block_gemm": ("mptrain.precision.quant.kernels", "block_gemm"),
    "block_gemm_available": ("mptrain.precision.quant.kernels", "block_gemm_available"),
    "fp8_gemm": ("mptrain.precision.quant.kernels", "fp8_gemm"),
    "fp8_gemm_available": ("mptrain.precision.quant.kernels", "fp8_gemm_available"),
    "transposed": ("mptrain.precision.quant.kernels", "transposed"),
    # the data path
    "ImageFolderConfig": ("mptrain.config.data", "ImageFolderConfig"),
    "batches": ("mptrain.data.batches", None),
    "decode": ("mptrain.data.decode", None),
    "feeds": ("mptrain.data.feeds", None),
    "folder": ("mptrain.data.folder", None),
    "data_build": ("mptrain.data.build", None),
    "CropSpec": ("mptrain.data.decode", "CropSpec"),
    "crop_params": ("mptrain.data.decode", "crop_params"),
    "draft_factor": ("mptrain.data.decode", "draft_factor"),
    # the performance model
    "gpus": ("mptrain.perf.gpus", None),
    "SAMPLES": ("mptrain.perf.gemms", "SAMPLES"),
    "account": ("mptrain.perf.gemms", "account"),
    "RooflineStep": ("mptrain.perf.roofline", "Step"),
    "arithmetic_for": ("mptrain.perf.roofline", "arithmetic_for"),
    "optimizer_passes": ("mptrain.perf.roofline", "optimizer_passes"),
    "predict": ("mptrain.perf.roofline", "predict"),
    "DataShape": ("mptrain.perf.speed", "DataShape"),
    "data_shape": ("mptrain.perf.speed", "data_shape"),
    "flops_by_format": ("mptrain.perf.speed", "flops_by_format"),
    "predict_config": ("mptrain.perf.speed", "predict_config"),
    # the hardware facts
    "contention": ("mptrain.platform.contention", None),
    "hardware_info": ("mptrain.platform.hardware", "hardware_info"),
    "software_versions": ("mptrain.platform.hardware", "software_versions"),
    "peak_memory_bytes": ("mptrain.platform.hardware", "peak_memory_bytes"),
    "reset_peak_memory": ("mptrain.platform.hardware", "reset_peak_memory"),
    "synchronize": ("mptrain.platform.hardware", "synchronize"),
}
__all__ = sorted([*_INTERNALS, "PREDICTOR", "compose"])


def compose(*overrides: str) -> Any:
    """The RunConfig ``mptrain *overrides`` would train, composed from the shipped YAML as the
    CLI composes it (Hydra's compose API, then ``to_run_config``); ConfigError for bad input."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from mptrain.cli.preflight import CONFIG_MODULE, CONFIG_NAME, HYDRA_VERSION_BASE
    from mptrain.cli.registry import register_configs, to_run_config

    register_configs()  # explicit: importing mptrain registers nothing
    GlobalHydra.instance().clear()  # a caller may have initialised Hydra already
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
        return to_run_config(hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides)))


def __getattr__(name: str) -> Any:
    if name in _INTERNALS:
        module, attribute = _INTERNALS[name]
        found = importlib.import_module(module)
        return found if attribute is None else getattr(found, attribute)
    raise AttributeError(f"module 'benchmarks.mptrain_api' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def main() -> int:
    """Import every name: one line per name that no longer imports (exit 1), else one line."""
    moved = []
    for name in _INTERNALS:
        try:
            __getattr__(name)
        except (ImportError, AttributeError) as exc:
            moved.append(f"{name}: {_INTERNALS[name]}: {type(exc).__name__}: {exc}")
    print("\n".join(moved) or f"all {len(_INTERNALS)} mptrain internals import")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
