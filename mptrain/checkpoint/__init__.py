"""Checkpoints and resume, in one room: the file's format, safe loading and the lookup of a
user's path (:mod:`.file`), when a training run saves and how a checkpoint is restored into the
run built now (:mod:`.checkpointer`), and what a resume checks and continues (:mod:`.resume`)."""
