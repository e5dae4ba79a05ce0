"""The commands beside training: bench, advise, eval, sample and the sweep summary / mptrain-compare."""
