"""Diagnostics before training (``audit=true`` / ``probe=true``): the autocast audit and the FP16
range probe on a run's first batches, written into the run directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from mptrain.train.components import Run

from mptrain.precision.diagnostics.audit import audit_step, render_audit
from mptrain.precision.diagnostics.probe import range_probe, render_probe
from mptrain.precision.policy import to_model_input
from mptrain.rundir.fileio import atomic_write_text, clean_json
from mptrain.rundir.layout import AUDIT_JSON, AUDIT_MD, PROBE_JSON, PROBE_MD


def write_diagnostics(run: Run, output_dir: Path, console: Console) -> None:
    """audit=true / probe=true: trace one step, or probe FP16 ranges, into files of the run
    directory (audit.md/.json, probe.md/.json); the model is left untouched."""
    cfg, policy = run.cfg, run.precision.policy
    if not (cfg.audit or cfg.probe):
        return
    batches = run.data.train.batches(0)
    first = [next(batches) for _ in range(cfg.probe_batches if cfg.probe else 1)]
    first = [(to_model_input(x, policy, cfg.channels_last), y) for x, y in first]
    if cfg.audit:
        audit = audit_step(
            run.model, *first[0], policy.autocast, run.optimizer, mixed=policy.master_weights
        )
        atomic_write_text(output_dir / AUDIT_JSON, json.dumps(audit, indent=2) + "\n")
        atomic_write_text(output_dir / AUDIT_MD, render_audit(audit))
        flags = len(audit["flagged_ops"]) + len(audit["state_flags"])
        console.print(f"audit: {len(audit['ops'])} op kinds traced, {flags} flagged -> audit.md")
    if cfg.probe:
        probe = range_probe(run.model, first, policy.scaler.init_scale)
        atomic_write_text(output_dir / PROBE_JSON, json.dumps(clean_json(probe), indent=2) + "\n")
        atomic_write_text(output_dir / PROBE_MD, render_probe(probe))
        console.print(f"FP16 range probe: {probe['verdict']} -> probe.md")
