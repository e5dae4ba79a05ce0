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
    ShortText,
    TextFacts,
    TokenText,
    TrainWindows,
    ValWindows,
    fixed_windows,
    read_text_dataset,
    split_tokens,
    text_left_unread,
    unigram_loss,
)

# A character vocabulary refuses a text with more than this share of bytes that are not UTF-8:
# it would learn U+FFFD in their place. Below it (a file cut mid-character, a stray byte) the
# count is noted in the data description and the report's data.text.
MAX_NOT_UTF8_SHARE = 0.01


# ------------------------------------------------------------------------------------------- text
def load_text(cfg: TextDatasetConfig) -> TokenText:
    """The text ``dataset.path`` names (default: the standard library's sources), tokenised.
    ConfigError naming ``dataset.path`` when there is no text, or when more than
    :data:`MAX_NOT_UTF8_SHARE` of it is not UTF-8 under ``dataset.vocabulary=chars``."""
    try:
        text = read_text_dataset(
            cfg.path, cfg.max_bytes, cfg.suffix, cfg.vocabulary, cfg.val_fraction
        )
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        raise ConfigError(f"dataset.path={_source_name(cfg)!r}: {exc}") from exc
    bad, total = text.not_utf8_bytes or 0, text.corpus.bytes
    if bad > MAX_NOT_UTF8_SHARE * total:
        raise ConfigError(
            f"dataset.path={_source_name(cfg)!r}: {bad:,} of its {total:,} bytes ({bad / total:.1%}) "
            "are not UTF-8, and dataset.vocabulary=chars would read each as U+FFFD; use "
            "dataset.vocabulary=bytes, or convert the text to UTF-8"
        )
    return text


def _source_name(cfg: TextDatasetConfig) -> str:
    return cfg.path or "the standard library"


def _short_text(cfg: TextDatasetConfig, text: TokenText, short: ShortText) -> ConfigError:
    """The refusal of a text whose ``short.split`` holds no window, naming the key to change:
    ``dataset.max_bytes`` when reading stopped there with text unread, else ``dataset.path``."""
    window = f"model.block_size + 1 = {short.block_size + 1}"
    read = f"{text.corpus.bytes:,} bytes ({len(text.tokens):,} tokens)"
    split = short.split
    if short.split == "validation":
        split = f"validation (the last dataset.val_fraction={cfg.val_fraction} of it)"
    if text_left_unread(cfg.path, cfg.max_bytes, cfg.suffix):
        return ConfigError(
            f"dataset.max_bytes={cfg.max_bytes}: the {read} read leave the {split} split "
            f"{short.tokens:,} tokens, fewer than one window of {window}; raise "
            "dataset.max_bytes, or lower model.block_size"
        )
    what = "is empty" if not text.corpus.bytes else f"has {read}"
    fixes = "a longer text or a smaller model.block_size"
    if short.split == "validation":
        fixes = "a longer text, a larger dataset.val_fraction or a smaller model.block_size"
    return ConfigError(
        f"dataset.path={_source_name(cfg)!r}: the text {what}, and its {split} split "
        f"{short.tokens:,} tokens, fewer than one window of {window}; use {fixes}"
    )


def text_bundle(cfg: TextDatasetConfig, text: TokenText, layout: BatchLayout) -> DataBundle:
    """Random training windows and fixed validation windows of ``layout.sequence_length``
    tokens, with the unigram baseline of the split."""
    block = layout.sequence_length
    if block is None:
        raise ConfigError("dataset=text: needs a language model (task=lm model=gpt)")
    try:
        split = split_tokens(text.tokens, cfg.val_fraction, block)
    except ShortText as short:
        raise _short_text(cfg, text, short) from None
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
        text.not_utf8_bytes,
    )
    kind = "bytes" if vocab.chars is None else f"{vocab.size} characters"
    if text.not_utf8_bytes:  # a share small enough to train on (load_text), not to hide
        plural = "s" if text.not_utf8_bytes > 1 else ""
        kind += f"; {text.not_utf8_bytes:,} byte{plural} not UTF-8, read as U+FFFD"
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
        identity=f"sha256:{text.corpus.content_sha256}",
    )
