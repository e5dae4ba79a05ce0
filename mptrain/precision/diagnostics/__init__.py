"""One-off numerics diagnostics: each runs once, on request, and reports; none trains.

- :mod:`.culprit`: the first module whose output or gradient went non-finite;
- :mod:`.audit`: the dtype every ATen op of one step really ran in, and what the quantization wants in FP32;
- :mod:`.probe`: how far activations sit below FP16's maximum, how many gradients FP16 would flush;
- :mod:`.hooks`: what the three share.

Every tool leaves the model as it found it (parameters, buffers, gradients, training flag and
RNG state), so running one never changes what training computes. Run before training by
:mod:`mptrain.train.diagnostics`; per-step health (``ScaleHealth``) lives in
:mod:`mptrain.train.monitor`, per-layer FP32 (``keep_in_fp32``, which changes the computation) in
:mod:`mptrain.precision.policy`.
"""
