"""Time and pace, in one room: the loop's clocks (:mod:`.clocks`), steps of copies of a run's
model timed before training (:mod:`.steptime`), how long a run will take and the slow-path note
(:mod:`.estimate`, decided in :mod:`.slowpath`), and the progress shown while it trains
(:mod:`.progress`)."""
