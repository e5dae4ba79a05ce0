"""What a run says: the typed report (report.json/.md), metrics.jsonl, the progress display, the job log, trackers and figures."""
