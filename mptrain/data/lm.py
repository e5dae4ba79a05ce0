"""The language-model task's data (``dataset=text``): the token text loaded once, and its bundle
of random training windows and fixed validation windows.
"""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

from mptrain.config.base import ConfigError
from mptrain.config.data import TextDatasetConfig
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.records import BadRecord, MissingReader
from mptrain.data.text import (
    ShortText,
    TextFacts,
    TokenText,
    TrainWindows,
    UnknownCharacters,
    ValWindows,
    Vocabulary,
    fixed_windows,
    read_text_dataset,
    split_tokens,
    unigram_loss,
)
from mptrain.data.tokenizer import TokenizerFileError, read_tokenizer_file

# A character vocabulary refuses a text with more than this share of bytes that are not UTF-8:
# it would learn U+FFFD in their place. Below it (a file cut mid-character, a stray byte) the
# count is noted in the data description and the report's data.text.
MAX_NOT_UTF8_SHARE = 0.01


# ------------------------------------------------------------------------------------------- text
def _check_source(cfg: TextDatasetConfig) -> None:
    """ConfigError naming ``dataset.path`` for a path that is neither a file nor a directory (a
    FIFO would block the run, /dev/zero never end) or a symbolic link that leads nowhere."""
    if not cfg.path:
        return  # the embedded standard-library corpus
    path = Path(cfg.path)
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"dataset.path={cfg.path!r}: a symbolic link that leads nowhere (or in a loop)"
        )
    if path.exists() and not (path.is_dir() or stat.S_ISREG(path.stat().st_mode)):
        raise ConfigError(
            f"dataset.path={cfg.path!r}: not a regular file or a directory (a pipe or a device?); "
            "give a text, .jsonl or .parquet file, or a directory of them"
        )


def load_text(cfg: TextDatasetConfig) -> TokenText:
    """The text ``dataset.path`` names (default: the standard library's sources), tokenised with
    ``dataset.tokenizer`` when one is given. ConfigError naming ``dataset.path`` when there is no
    text or a record holds none (file, line and field), or when more than
    :data:`MAX_NOT_UTF8_SHARE` of it is not UTF-8 under a characters or tokenizer vocabulary;
    naming ``dataset.tokenizer`` when its file is missing or unreadable, or the ``tokenizers``
    library is not installed."""
    tokenizer = None
    if cfg.tokenizer is not None:
        try:
            tokenizer = read_tokenizer_file(Path(cfg.tokenizer))
        except (OSError, TokenizerFileError, ImportError) as exc:
            raise ConfigError(f"dataset.tokenizer={cfg.tokenizer!r}: {exc}") from None
    _check_source(cfg)
    try:
        text = read_text_dataset(
            cfg.path,
            cfg.max_bytes,
            cfg.suffix,
            cfg.vocabulary,
            cfg.val_fraction,
            tokenizer=tokenizer,
            text_field=cfg.text_field,
        )
    except (FileNotFoundError, NotADirectoryError, PermissionError, BadRecord) as exc:
        raise ConfigError(f"dataset.path={_source_name(cfg)!r}: {exc}") from exc
    except MissingReader as exc:
        raise ConfigError(f"dataset.path={_source_name(cfg)!r}: {exc}") from None
    _check_fields_apply(cfg, text)
    bad, total = text.not_utf8_bytes or 0, text.corpus.bytes
    if bad > MAX_NOT_UTF8_SHARE * total:
        which = "dataset.tokenizer" if cfg.tokenizer else "dataset.vocabulary=chars"
        raise ConfigError(
            f"dataset.path={_source_name(cfg)!r}: {bad:,} of its {total:,} bytes ({bad / total:.1%}) "
            f"are not UTF-8, and {which} would read each as U+FFFD; use "
            "dataset.vocabulary=bytes, or convert the text to UTF-8"
        )
    return text


def text_in_vocabulary(cfg: TextDatasetConfig, vocab: Vocabulary) -> TokenText:
    """The text of ``cfg`` (:func:`load_text`) in the character vocabulary ``vocab`` (a
    checkpoint's), so each id means the character it meant in training: a checkpoint written
    before issue 29 has an unknown id 0 and one id more than the text's own vocabulary. ConfigError
    naming ``dataset.path`` for characters ``vocab`` lacks and has no unknown id for."""
    text = load_text(cfg)
    try:  # table[id of the text's vocabulary] = the id of the same character in ``vocab``
        table = vocab.encode((text.vocabulary.chars or "").encode("utf-8"))
    except UnknownCharacters as exc:
        raise ConfigError(
            f"dataset.path={_source_name(cfg)!r}: {exc}, which the model was never trained on; "
            "evaluate on its training text"
        ) from None
    return dataclasses.replace(text, tokens=table[text.tokens], vocabulary=vocab)


def _check_fields_apply(cfg: TextDatasetConfig, text: TokenText) -> None:
    """No silent no-op: ``dataset.text_field`` set for plain text, which has no fields."""
    if cfg.text_field != "text" and text.corpus.documents is None:
        raise ConfigError(
            f"dataset.text_field={cfg.text_field!r}: names the field of .jsonl or .parquet "
            f"records; dataset.path={_source_name(cfg)!r} is plain text (leave it at text)"
        )


def _source_name(cfg: TextDatasetConfig) -> str:
    return cfg.path or "the standard library"


def _short_text(cfg: TextDatasetConfig, text: TokenText, short: ShortText) -> ConfigError:
    """The refusal of a text whose ``short.split`` holds no window, naming the key to change:
    ``dataset.max_bytes`` when reading stopped there with text unread, else ``dataset.path``."""
    window = f"model.block_size + 1 = {short.block_size + 1}"
    read = f"{text.corpus.bytes:,} bytes ({len(text.tokens):,} tokens)"
    split, fixes = short.split, "a longer text or a smaller model.block_size"
    if short.split == "validation":
        split = f"validation (the last dataset.val_fraction={cfg.val_fraction} of it)"
        fixes = "a longer text, a larger dataset.val_fraction or a smaller model.block_size"
    if text.left_unread:
        return ConfigError(
            f"dataset.max_bytes={cfg.max_bytes}: the {read} read leave the {split} split "
            f"{short.tokens:,} tokens, fewer than one window of {window}; raise "
            "dataset.max_bytes, or lower model.block_size"
        )
    what = "is empty" if not text.corpus.bytes else f"has {read}"
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
        tokenizer_file=cfg.tokenizer,
        separator=text.separator,
    )
    kind = _vocabulary_words(vocab, cfg)
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
        description=f"text: {_files_words(text)}, {len(split.train)} train / "
        f"{len(split.val)} val tokens ({kind}), windows of {block}",
        sequence_length=block,
        text=facts,
        identity=facts.identity,
    )


def _files_words(text: TokenText) -> str:
    """``3 files``, or for records ``2 files, 1,200 documents``."""
    documents = text.corpus.documents
    return f"{text.corpus.files} files" + (
        "" if documents is None else f", {documents:,} documents"
    )


def _vocabulary_words(vocab: Vocabulary, cfg: TextDatasetConfig) -> str:
    """The vocabulary in the data line: ``bytes``, ``65 characters``, ``tokenizer.json: 50,257
    tokens``."""
    if vocab.kind == "tokenizer":
        return f"{Path(cfg.tokenizer or '').name}: {vocab.size:,} tokens"
    return "bytes" if vocab.kind == "bytes" else f"{vocab.size} characters"
