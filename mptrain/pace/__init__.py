"""Time and pace, in one room: the loop's clocks (:mod:`.clocks`), steps of copies of a run's
model timed before training (:mod:`.steptime`), how long a run will take and the slow-path note
(:mod:`.estimate`, decided in :mod:`.slowpath`), the progress shown while it trains
(:mod:`.progress`), and speed figures from repeated measurements with their spread
(:mod:`.spread`)."""
