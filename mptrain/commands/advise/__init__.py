"""``mptrain advise [overrides]``: which precision to train this model with on this machine.

For every precision :func:`mptrain.commands.bench.bench_precisions` lists for the device (FP32, BF16 where
native, FP16, TF32 on GPUs) and every low-precision choice (:data:`.choices.LOW_PRECISION`: FP8
tensorwise, rowwise, delayed, power-of-two scales, blockwise; MXFP8, NVFP4; emulated and labelled where the device lacks the
hardware) it measures, on the configured model and data, in this order:

1. **pilot**: builds the run and trains a few steps, timed: what a step and a run's set-up cost
   here. A scout step on 4 samples goes before each (scaled by FP32's own small-to-full ratio):
   that is how the budget learns that FP16 convolutions crawl on a CPU — measured, not assumed.
2. **numerics** (on FP32's initial weights, before any training): the FP16 range probe, the
   autocast audit under each low-precision autocast, and the FP8 layer choice (from FP8's pilot).
3. **fidelity**: ``advise.fidelity_steps`` optimizer steps per precision from the same seed (the
   same initial weights and batches) as an FP32 run; the loss trajectories are compared
   (:func:`mptrain.commands.advise.decide.fidelity_of`), skipped steps and divergence recorded.
   With ``advise.plan``: the **per-layer plan** (:mod:`.layers`, :mod:`.sensitivity`,
   :mod:`.plan`) for the low-precision choice advise is likeliest to recommend: each layer it
   converts measured for sensitivity on one batch in its own format, ranked, and the fewest
   layers kept in high precision (its exclude key: ``fp8.exclude``, ``mx.exclude``,
   ``nvfp4.exclude``) that bring its loss within the allowance, verified by short runs.
4. **speed**: bench's alternating repetitions (:func:`mptrain.commands.bench.measure_reps`), in rotated
   order, ``advise.reps`` times; ratios to FP32 with their min–max (emulated FP8 is not timed).
5. **memory** (:mod:`.footprint`, :mod:`.fits`; first after the pilots when
   ``advise.batch_size`` asks what fits): one step's bytes accounted per precision, checkpointing
   mode and optimizer-state choice at two small micro-batches, a line in the batch; on
   ``advise.target``'s GPU the largest micro-batch of each, and for ``advise.batch_size`` the
   cheapest combination that fits, its step-time cost measured here and, where advise runs on
   that GPU, its peak measured there (:mod:`.fit_measure`).
6. **seeds** (``advise.seeds``): the finalists of a provisional decision run their fidelity run
   over more seeds; :mod:`.confidence` gives each an equivalence verdict on the final loss.

The measured costs decide what fits ``advise.budget_s``: FP32 first (the reference), then each
precision whole (its fidelity run and its speed measurement together: one without the other
cannot be recommended), each estimated from what was measured when its turn comes; what does not
fit is skipped and listed with the estimate that ruled it out. Every run also stops at the
budget's deadline between steps (a step cannot be interrupted). :func:`mptrain.commands.advise.decide.recommend`
decides; :mod:`mptrain.commands.advise.report` writes advise.md, advise.json and advise.png into
``outputs/advise/<date>/<time>_<model>_<dataset>`` (or ``hydra.run.dir=DIR``) and prints the
recommendation and the table.

Modules: :mod:`.choices` (the candidates as data, their commands), :mod:`.footprint` and
:mod:`.fits` (what fits a GPU: accounted, decided), :mod:`.fit_measure` (the recommended
combination's speed cost and measured peak), :mod:`.fit_report` (its section), :mod:`.trials` (one short run,
the budget), :mod:`.measure` (every precision within the budget), :mod:`.seeds` (the finalists'
seeds), :mod:`.confidence` (the equivalence test, pure), :mod:`.decide` (the decision as a pure
function), :mod:`.layers`, :mod:`.sensitivity` and :mod:`.plan` (the per-layer plan: run, measured, decided),
:mod:`.report` (advise.md/.json/.png), :mod:`.run` (the command).
"""
