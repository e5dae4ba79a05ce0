"""The performance model, predicted rather than measured: a model's GEMMs and bytes counted on the
meta device (:mod:`.gemms`), GPUs' cited peaks and the FLOP-weighted peak for MFU (:mod:`.gpus`),
a step's roofline on a named GPU (:mod:`.roofline`) and a run's predicted speed per precision
(:mod:`.speed`: the one module here that builds a model and data, on the meta device)."""
