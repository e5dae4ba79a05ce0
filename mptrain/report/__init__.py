"""The run report, in one room: its schema and reader (:mod:`.schema`), its assembly from a
finished, failed or interrupted job (:mod:`.assemble`), and its writing and rendering
(:mod:`.render`, with the optional sections' rows in :mod:`.rows`)."""
