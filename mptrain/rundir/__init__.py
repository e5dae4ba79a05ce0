"""The run directory on disk: its file names, its lock and overwrite rule, atomic writes, and the command that made and continues a run."""
