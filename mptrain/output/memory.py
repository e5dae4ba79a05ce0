"""The summary's memory rows: one training step's accounted bytes by kind and dtype, and their
total beside the measured peak (the accounting: :mod:`mptrain.train.memory`)."""

from __future__ import annotations

from mptrain.output.report import MemorySection


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


# What a peak holds besides one step's accounted tensors, by what the peak measures.
_UNACCOUNTED = {
    "cuda_max_allocated": "the forward's temporaries autograd did not save, the optimizer's "
    "scratch, the evaluation's batches, and the copies the accounting step made",
    None: "the interpreter, torch's libraries and threads, the data in memory, the "
    "allocator's caches, temporaries that are never saved, and the accounting step's copies",
}


def memory_rows(memory: MemorySection) -> list[tuple[str, str]]:
    """One row per kind of one training step's accounted bytes, by dtype, then the total beside
    the measured peak (mptrain.train.memory)."""
    accounted = memory.accounted
    if not accounted:
        return []
    if "not_counted" in accounted:
        return [("memory", f"not accounted: {accounted['not_counted']}")]
    rows = []
    for kind, by_dtype in accounted["bytes"].items():
        if by_dtype:
            parts = ", ".join(f"{fmt_bytes(n)} {dtype}" for dtype, n in by_dtype.items())
            rows.append((f"  {kind.replace('_', ' ')}", parts))
    total = f"{fmt_bytes(accounted['total_bytes'])} in one step"
    if accounted.get("recomputed_blocks"):
        total += f", {accounted['recomputed_blocks']} blocks recomputed in the backward"
    if memory.peak_bytes is not None:
        rest = memory.peak_bytes - accounted["total_bytes"]
        why = _UNACCOUNTED.get(memory.kind or "", _UNACCOUNTED[None])
        total += f" (peak {fmt_bytes(memory.peak_bytes)}: {fmt_bytes(rest)} more, {why})"
    return [("memory accounted", total), *rows]
