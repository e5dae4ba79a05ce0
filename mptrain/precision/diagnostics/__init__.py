"""One-off numerics diagnostics (:mod:`.culprit`, :mod:`.audit`, :mod:`.probe`; :mod:`.hooks`
what they share): each runs once, on request, and reports; none trains.

Every tool leaves the model as it found it (parameters, buffers, gradients, training flag and
RNG state), so running one never changes what training computes. Run before training by
:mod:`mptrain.train.diagnostics`; per-step health (``ScaleHealth``) lives in
:mod:`mptrain.train.monitor`, per-layer FP32 (``keep_in_fp32``, which changes the computation) in
:mod:`mptrain.precision.policy`.
"""
