"""A resumed threads=auto run keeps the thread count in effect at its checkpoint (issue 39,
item 11). The count changes the order of floating-point sums: with the default threads=auto,
SIGTERM then resume=auto ended at a validation loss of 0.10696109135945638 against
0.10696110195583768 uninterrupted, because the resumed run measured the counts again."""

from __future__ import annotations

import torch
from support.runs import tiny_run, train

from mptrain.checkpoint.file import load_checkpoint
from mptrain.rundir.layout import CHECKPOINT_DIR
from mptrain.train.threads import ThreadChoice, kept_from_checkpoint

AUTO = ThreadChoice("auto", 2, "auto", "2 usable CPUs")


def test_the_checkpoints_count_is_kept_and_not_measured_again():
    before = torch.get_num_threads()
    try:
        kept = kept_from_checkpoint(AUTO, (None, {"threads": 1, "loop": {"step": 40}}, []))
        assert (kept.threads, kept.measure, torch.get_num_threads()) == (1, False, 1)
        assert kept.mode == "auto, kept from the checkpoint"
        assert kept.basis.startswith("1, the count in effect at the checkpoint's step 40")
    finally:
        torch.set_num_threads(before)


def test_pinned_unmeasured_fresh_or_older_runs_keep_their_choice():
    pinned = ThreadChoice("3", 3, "pinned", "pinned by threads=3")
    payload = (None, {"threads": 1, "loop": {"step": 4}}, [])
    assert kept_from_checkpoint(pinned, payload) is pinned
    assert kept_from_checkpoint(AUTO, None) is AUTO  # no checkpoint
    assert kept_from_checkpoint(AUTO, (None, {"loop": {"step": 4}}, [])) is AUTO  # none recorded


def test_a_resumed_auto_run_records_the_kept_count(tmp_path):
    out = tmp_path / "run"
    overrides = ("threads=auto", "max_steps=8", "checkpoint.every_steps=4")
    train(tiny_run(*overrides, "max_steps=4"), out)
    saved = load_checkpoint(out / CHECKPOINT_DIR / "step_00000004.pt")["threads"]
    assert isinstance(saved, int) and saved >= 1
    report = train(tiny_run(*overrides, "resume=auto", "resume_allow_changes=true"), out)
    threads = report["threads"]
    assert (threads["mode"], threads["initial"]) == ("auto, kept from the checkpoint", saved)
    assert threads["measurements"] == [] and threads["changes"] == []
