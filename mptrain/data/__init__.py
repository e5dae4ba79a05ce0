"""What a run reads: datasets and how batches reach the model.

Entry point: :func:`mptrain.data.build.build_data` with the dataset config and a
:class:`~mptrain.data.batches.BatchLayout`; :data:`mptrain.data.build.DATASETS` maps each
``dataset.name`` to its schema and loader. The two feeds and their determinism: :mod:`.feeds`;
the user's own datasets and their contract: :mod:`.custom` and docs/custom-code.md.

Raw files are only read from ``root``; nothing downloads unless ``download=true`` is set. A missing
dataset raises :class:`~mptrain.config.base.ConfigError` naming the path and how to get the files.
"""
