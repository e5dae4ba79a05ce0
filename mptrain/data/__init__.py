"""What a run reads: datasets and how batches reach the model.

Two feeds, chosen by where the data lives:

- :class:`TensorBatches` for data held in memory (digits, synthetic, CIFAR, MNIST, Fashion-MNIST):
  one shuffled index per epoch, batches gathered by tensor indexing, augmentation applied to whole
  batches on the device. No per-sample Python, no worker processes: on small models this is ~1.7x
  faster than a per-sample DataLoader.
- :class:`LoaderBatches` for file-backed data too large for memory (imagefolder): a DataLoader with
  worker processes decoding images, pinned memory and non-blocking copies on CUDA.

``dataset=custom dataset._target_=my_pkg.make_data`` (:func:`load_custom`) takes the user's own
datasets. Contract: ``_target_`` names a callable (built by ``hydra.utils.instantiate`` with the
``+dataset.*`` keys, and ``num_classes`` when it takes it and ``dataset.num_classes`` is set) that
returns ``(train, val)``, two map-style ``torch.utils.data.Dataset`` objects (``__len__`` and
``__getitem__``) whose samples are ``(image, label)``: a float tensor ``C x H x W`` with
``H == W`` (normalised and augmented by the dataset itself: mptrain adds nothing) and an ``int``
label in ``0 .. num_classes-1``. ``num_classes`` is ``dataset.num_classes``, else
``len(train.classes)``. Feed: ``dataset.in_memory=true`` reads every sample once into tensors
(:class:`TensorBatches`); ``false`` serves them through DataLoader workers (:class:`LoaderBatches`,
``num_workers``); ``null`` (default) picks the tensor feed when both sets are
``torch.utils.data.TensorDataset`` (their tensors are used as they are) and the DataLoader
otherwise. The first sample of each set is checked (shape, dtype, label) before training.

Both yield ``(images, labels)`` already on the training device, and are deterministic given
``(seed, epoch)``: the data order of epoch ``e`` does not depend on what ran before it.

Entry point: :func:`mptrain.data.build.build_data` with the dataset config and a :class:`BatchLayout`;
:data:`mptrain.data.build.DATASETS` maps each ``dataset.name`` to its schema and the function that loads it.

Raw files are only read from ``root``; nothing downloads unless ``download=true`` is set. A missing
dataset raises :class:`~mptrain.config.base.ConfigError` naming the path and how to get the files.
"""
