"""What a run says as it goes: metrics.jsonl, the job log, trackers and figures (its report:
:mod:`mptrain.report`; its progress display: :mod:`mptrain.pace`)."""
