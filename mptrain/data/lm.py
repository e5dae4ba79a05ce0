"""The language-model task's data (``dataset=text``): the token text loaded once, and its bundle
of random training windows and fixed validation windows.
"""

from __future__ import annotations

from mptrain.config.base import ConfigError
from mptrain.config.data import (
    TextDatasetConfig,
)
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.text import (
    TextFacts,
    TokenText,
    TrainWindows,
    ValWindows,
    fixed_windows,
    read_text_dataset,
    split_tokens,
    unigram_loss,
)


# ------------------------------------------------------------------------------------------- text
def load_text(cfg: TextDatasetConfig) -> TokenText:
    """The text ``dataset.path`` names (default: the standard library's sources), tokenised."""
    try:
        return read_text_dataset(
            cfg.path, cfg.max_bytes, cfg.suffix, cfg.vocabulary, cfg.val_fraction
        )
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        where = cfg.path or "the standard library"
        raise ConfigError(f"dataset.path={where!r}: {exc}") from exc


def text_bundle(cfg: TextDatasetConfig, text: TokenText, layout: BatchLayout) -> DataBundle:
    """Random training windows and fixed validation windows of ``layout.sequence_length``
    tokens, with the unigram baseline of the split."""
    block = layout.sequence_length
    if block is None:
        raise ConfigError("dataset=text: needs a language model (task=lm model=gpt)")
    try:
        split = split_tokens(text.tokens, cfg.val_fraction, block)
    except ValueError as exc:
        raise ConfigError(f"dataset.max_bytes={cfg.max_bytes}: {exc}") from exc
    where = {"rank": layout.rank, "world": layout.world}
    train = TrainWindows(
        split.train, block, layout.batch_size, layout.device, seed=layout.seed, **where
    )
    if train.num_batches < 1:
        raise ConfigError(
            f"batch_size={layout.batch_size}: one batch needs more than the "
            f"{len(split.train) // block} windows of {block} tokens the training text holds"
        )
    val = ValWindows(
        split.val, block, cfg.val_windows, layout.eval_batch_size, layout.device, **where
    )
    vocab = text.vocabulary
    facts = TextFacts(
        text.corpus,
        vocab,
        block,
        len(split.train),
        len(split.val),
        val.windows,
        # On the very tokens the validation loss is measured on.
        unigram_loss(split.train, fixed_windows(split.val, block, cfg.val_windows)[1], vocab.size),
    )
    kind = "bytes" if vocab.chars is None else f"{vocab.size} characters"
    return DataBundle(
        train=train,
        val=val,
        num_classes=vocab.size,
        in_channels=0,
        image_size=0,
        num_train=len(split.train) // block,
        num_val=val.windows,
        description=f"text: {text.corpus.files} files, {len(split.train)} train / "
        f"{len(split.val)} val tokens ({kind}), windows of {block}",
        sequence_length=block,
        text=facts,
    )
