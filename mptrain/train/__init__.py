"""One training job, config in, report out: resolve and build, the loop, measurements, precision
schedules and threads (its report: :mod:`mptrain.report`; its checkpoints: :mod:`mptrain.checkpoint`;
its clocks: :mod:`mptrain.pace`)."""
