"""One training job, config in, report out: resolve and build, the loop, measurements, checkpointing and report assembly."""
