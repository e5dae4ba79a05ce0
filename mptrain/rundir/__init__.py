"""The run directory on disk: its lock and overwrite rule, atomic writes, and the checkpoint file format and lookup."""
