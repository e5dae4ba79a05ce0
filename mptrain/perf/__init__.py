"""The performance model: what a step costs on a GPU, predicted rather than measured.

- :mod:`.gemms`: a model's GEMMs and the bytes they move, counted on the meta device;
- :mod:`.gpus`: published GPU peaks per format and memory bandwidth, with their citations, and
  the FLOP-weighted peak MFU divides by;
- :mod:`.roofline`: the roofline of one training step on a named GPU, per precision;
- :mod:`.speed`: a run's predicted speed per precision (builds the model and data on the meta
  device: nothing in :mod:`mptrain.precision` builds either).

A layer between ``precision`` (whose formats it prices) and ``train`` (whose report shows MFU),
as torchao keeps its roofline in a testing utility and torchtitan its peak FLOPs in a tools module.
"""
