"""``mptrain advise [overrides]``: which precision to train this model with on this machine
(docs/advise.md: what it measures, how it decides, its keys and output, with examples).

Every precision :func:`mptrain.commands.bench.bench_precisions` lists for the device and every
low-precision choice (:data:`.choices.LOW_PRECISION`; emulated and labelled where the device lacks
the hardware) is measured on the configured model and data, in this order (:func:`.run.measure_all`
runs them):

1. **pilot** (:mod:`.measure`): a few timed steps, after a scout step on 4 samples (scaled by
   FP32's own small-to-full ratio) that foresees a step too slow to fit;
2. **numerics** (on FP32's initial weights): the FP16 range probe, the autocast audit, the layer
   choice of each low-precision format (from its pilot);
3. **fidelity**: ``advise.fidelity_steps`` steps per precision from FP32's seed, the loss
   trajectories compared (:func:`.decide.fidelity_of`); with ``advise.plan``, the per-layer plan
   (:mod:`.layers`);
4. **speed**: bench's alternating repetitions (:func:`mptrain.commands.bench.measure_reps`),
   ``advise.reps`` times; emulated formats are not timed;
5. **memory** (:mod:`.footprint`; first after the pilots when ``advise.batch_size`` asks what
   fits): one step's bytes accounted, what fits ``advise.target``'s GPU (:mod:`.fits`), and the
   recommended combination measured (:mod:`.fit_measure`);
6. **seeds** (:mod:`.seeds`): the finalists' fidelity runs over more seeds, an equivalence verdict
   each (:mod:`.confidence`).

The budget (``advise.budget_s``, :class:`.trials.Budget`) admits FP32 first (the reference), then
each precision whole (its fidelity run and its speed measurement together: one without the other
cannot be recommended), each estimated from what was measured; what does not fit is skipped and
listed with the estimate that ruled it out, and every run stops at the deadline between steps.
:func:`.decide.recommend` decides; :mod:`.report` writes advise.md, advise.json and advise.png.
"""
