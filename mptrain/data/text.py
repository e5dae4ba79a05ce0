"""Text for language modelling: the corpus read, its tokens, and the windows a model trains on.

The default corpus is the running interpreter's standard library sources (which files, and why:
docs/language-models.md); what was read is recorded (:class:`CorpusFacts`). The token stream is
split once (:func:`split_tokens`): the first ``1 - val_fraction`` trains, the rest validates, and
no window crosses the boundary, so no validation token is ever seen in training.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mptrain.data.records import RECORD_SUFFIXES, join_records
from mptrain.data.tokenizer import (
    end_of_text,
    parse_tokenizer,
    tokenizer_sha256,
    vocabulary_size,
)
from mptrain.platform.hardware import MAX_DEVICE_RESIDENT_BYTES
from mptrain.platform.seeding import ORDER_STREAM, epoch_generator

# Directories of the standard library that are test suites or third-party code, not the library.
_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
# Joins the records of .jsonl/.parquet files when the tokenizer has no end-of-text token.
PLAIN_DOCUMENT_SEPARATOR = "\n\n"
# Id 0 of the character vocabularies of checkpoints before issue 29: every character not in them.
UNKNOWN_CHAR = "\x00"


@dataclass(frozen=True)
class CorpusFacts:
    """What was read: where from, how many files and bytes, and a digest of the file list."""

    source: str  # "python stdlib <version dir>" or the path given
    files: int
    bytes: int
    file_list_sha256: str  # of the newline-joined relative paths, in reading order
    first_file: str | None
    last_file: str | None
    content_sha256: str = ""  # of the bytes read: a resumed run must train on the same text
    documents: int | None = None  # .jsonl / .parquet: the records read (None: plain text files)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, suffix: str = ".py") -> list[Path]:
    """The files a corpus directory contributes, in a deterministic (sorted) order; test suites
    and site-packages left out. A file given as ``root`` is the whole list."""
    if root.is_file():
        return [root]
    found = (p for p in root.rglob(f"*{suffix}") if p.is_file())
    return sorted(p for p in found if not _SKIPPED_PARTS & set(p.relative_to(root).parts[:-1]))


def read_corpus(
    root: Path,
    max_bytes: int,
    suffix: str = ".py",
    *,
    text_field: str = "text",
    separator: str = PLAIN_DOCUMENT_SEPARATOR,
) -> tuple[bytes, CorpusFacts]:
    """The text of ``root`` and what was read: plain-text files concatenated (whole files, in
    order, until ``max_bytes``; a single file is cut at ``max_bytes``), or for ``.jsonl`` and
    ``.parquet`` files their records' ``text_field`` joined with ``separator``
    (:func:`mptrain.data.records.join_records`). FileNotFoundError when ``root`` does not exist
    or holds no ``suffix`` file; BadRecord for a record without text."""
    text, facts, _ = _read_source(root, max_bytes, suffix, text_field, separator)
    return text, facts


def _read_source(
    root: Path, max_bytes: int, suffix: str, text_field: str, separator: str
) -> tuple[bytes, CorpusFacts, bool]:
    """:func:`read_corpus`, and whether text was left unread at ``max_bytes``."""
    if not root.exists():
        raise FileNotFoundError(
            f"{root} does not exist; give a file or a directory of {suffix} files"
        )
    files = corpus_files(root, suffix)
    if not files:
        raise FileNotFoundError(f"{root}: no {suffix} files to read")
    documents = None
    if (root.suffix if root.is_file() else suffix).lower() in RECORD_SUFFIXES:
        rec = join_records(files, text_field, separator, max_bytes)
        text, used, documents, left_unread = rec.data, rec.files, rec.documents, rec.left_unread
    else:
        text, used, left_unread = _join_files(files, max_bytes)
    names = [str(p.relative_to(root)) if p != root else p.name for p in used]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    content = hashlib.sha256(text).hexdigest()
    first, last = (names[0], names[-1]) if names else (None, None)
    facts = CorpusFacts(str(root), len(used), len(text), digest, first, last, content, documents)
    return text, facts, left_unread


def _join_files(files: list[Path], max_bytes: int) -> tuple[bytes, list[Path], bool]:
    """Whole files in order until the next would pass ``max_bytes`` (the first one cut there):
    their bytes, the files used, and whether any text was left unread."""
    chunks, used, total = [], [], 0
    for path in files:
        data = path.read_bytes()
        if total and total + len(data) > max_bytes:
            return b"".join(chunks), used, True
        chunks.append(data[: max_bytes - total])
        used.append(path)
        total += len(chunks[-1])
        if len(chunks[-1]) < len(data):
            return b"".join(chunks), used, True
    return b"".join(chunks), used, False


@dataclass(frozen=True)
class Vocabulary:
    """Token ids for bytes (id = byte value), for characters (``chars``), or from a tokenizer file
    (``tokenizer``: a ``tokenizer.json``'s content, see :mod:`mptrain.data.tokenizer`).

    ``encode`` takes text (as ``decode`` gives it) or bytes, read as UTF-8 (a byte that is not
    UTF-8 as U+FFFD) by a characters or tokenizer vocabulary; a character it lacks raises
    :class:`UnknownCharacters` unless it has an ``unknown_id`` (older checkpoints' only).
    ``decode`` gives text, a tokenizer's special tokens kept (an end-of-text token shows where a
    document ended)."""

    chars: str | None = None
    tokenizer: str | None = field(default=None, repr=False)  # a few MB: not in messages
    unknown_id: int | None = None  # the id of characters not in ``chars`` (None: refused)

    @property
    def kind(self) -> str:
        """``bytes``, ``chars`` or ``tokenizer`` (the report's ``data.text.vocabulary``)."""
        if self.tokenizer is not None:
            return "tokenizer"
        return "bytes" if self.chars is None else "chars"

    @functools.cached_property
    def _tokenizer(self) -> Any:
        return parse_tokenizer(self.tokenizer or "")

    @property
    def size(self) -> int:
        if self.tokenizer is not None:
            return vocabulary_size(self._tokenizer)
        return 256 if self.chars is None else len(self.chars)

    @property
    def end_of_text(self) -> str | None:
        """The tokenizer's end-of-text special token (:data:`END_OF_TEXT_TOKENS`), else None."""
        return None if self.tokenizer is None else end_of_text(self._tokenizer)

    @classmethod
    def of_characters(cls, text: str) -> Vocabulary:
        """Every character of ``text``, sorted, and nothing else: no unknown id, as nanoGPT's
        ``chars = sorted(list(set(data)))`` (its 65 symbols for tiny Shakespeare)."""
        return cls("".join(sorted(set(text))))

    def encode(self, data: str | bytes) -> torch.Tensor:
        """The token ids (int64, 1-D) of ``data``, text or bytes (see the class doc)."""
        if self.kind == "bytes":  # text as UTF-8; PEP 383 escapes as the bytes they stand for
            data = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
            return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
        text = data if isinstance(data, str) else data.decode("utf-8", errors="replace")
        if self.tokenizer is not None:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            return torch.tensor(ids, dtype=torch.int64)
        index = {c: i for i, c in enumerate(self.chars)}
        missing = set(text) - index.keys() if self.unknown_id is None else set()
        if missing:
            raise UnknownCharacters(sorted(missing))
        return torch.tensor([index.get(c, self.unknown_id) for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.tokenizer is not None:
            return self._tokenizer.decode(values, skip_special_tokens=False)
        if self.chars is None:
            return bytes(values).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in values)

    def checkpoint_facts(self) -> dict[str, Any]:
        """What a checkpoint stores to rebuild this vocabulary (:meth:`of_checkpoint`): the
        characters, the unknown id, and the tokenizer file's content whole, so a checkpoint is
        self-contained."""
        return {
            "vocabulary": self.chars,
            "tokenizer": self.tokenizer,
            "unknown_id": self.unknown_id,
        }

    @classmethod
    def of_checkpoint(cls, data: dict[str, Any]) -> Vocabulary:
        """The vocabulary a checkpoint's data facts describe. Facts without ``unknown_id`` are
        older: their characters (if any) start with :data:`UNKNOWN_CHAR`, id 0 the unknown one."""
        chars = data.get("vocabulary")
        older = chars is not None and "unknown_id" not in data
        return cls(chars, data.get("tokenizer"), 0 if older else data.get("unknown_id"))


class UnknownCharacters(ValueError):
    """A text holds characters a character vocabulary without an unknown id lacks."""

    def __init__(self, missing: list[str]) -> None:
        shown = ", ".join(repr(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
        super().__init__(f"{len(missing)} character(s) not in the vocabulary: {shown}")
        self.missing = missing


@dataclass(frozen=True)
class TokenSplit:
    """The token stream split once: ``train`` then ``val``, never overlapping."""

    train: torch.Tensor
    val: torch.Tensor


class ShortText(ValueError):
    """A split of the token stream holds no window: ``split`` ("training" or "validation") has
    ``tokens`` tokens, fewer than ``block_size + 1``."""

    def __init__(self, split: str, tokens: int, block_size: int) -> None:
        super().__init__(
            f"the {split} text has {tokens} tokens, fewer than one window of "
            f"block_size + 1 = {block_size + 1}"
        )
        self.split, self.tokens, self.block_size = split, tokens, block_size


def split_tokens(tokens: torch.Tensor, val_fraction: float, block_size: int) -> TokenSplit:
    """The first ``1 - val_fraction`` of ``tokens`` for training, the rest for validation; each
    part must hold at least one window of ``block_size + 1`` tokens (inputs and next tokens), else
    :class:`ShortText` naming the first part that does not."""
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < block_size + 1:
            raise ShortText(name, len(part), block_size)
    return TokenSplit(train, val)


def random_windows(
    tokens: torch.Tensor, block_size: int, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows at random offsets: inputs ``(count, block_size)`` and next tokens (on
    ``tokens``' device, drawn from ``generator`` on that device)."""
    starts = torch.randint(
        0, len(tokens) - block_size, (count,), generator=generator, device=tokens.device
    )
    rows = starts[:, None] + torch.arange(block_size + 1, device=tokens.device)
    windows = tokens[rows]
    return windows[:, :-1], windows[:, 1:]


def fixed_windows(
    tokens: torch.Tensor, block_size: int, max_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_windows`` consecutive, non-overlapping windows from the start of ``tokens``:
    the same validation set on every evaluation and every run."""
    count = min(max_windows, (len(tokens) - 1) // block_size)
    starts = torch.arange(count, device=tokens.device) * block_size
    rows = starts[:, None] + torch.arange(block_size + 1, device=tokens.device)
    windows = tokens[rows]
    return windows[:, :-1], windows[:, 1:]


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) on ``val`` of the unigram model of ``train``: each token's
    frequency in the training text, add-one smoothed so a token training never saw costs a finite
    amount. The loss of a model that ignores context entirely."""
    counts = torch.bincount(train.cpu(), minlength=vocab_size).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return float(-log_p[val.cpu().reshape(-1)].mean())


# ------------------------------------------------------------------------------------ the feeds
@dataclass(frozen=True)
class TextFacts:
    """What a language-model run trained on: the corpus, the vocabulary, the split and the
    unigram baseline (report, checkpoints, ``mptrain sample``)."""

    corpus: CorpusFacts
    vocabulary: Vocabulary
    block_size: int
    train_tokens: int
    val_tokens: int
    val_windows: int
    unigram_val_loss: float
    not_utf8_bytes: int | None = None  # character vocabulary: bytes read as U+FFFD
    tokenizer_file: str | None = None  # dataset.tokenizer, as given
    separator: str | None = None  # what joined the documents of .jsonl/.parquet files

    def describe(self) -> dict[str, Any]:
        """The report's ``data.text`` entry (plain types): with a tokenizer, its file, SHA-256
        and end-of-text token under ``tokenizer``."""
        return {
            **dataclasses.asdict(self.corpus),
            "vocabulary": self.vocabulary.kind,
            "vocab_size": self.vocabulary.size,
            "tokenizer": self._tokenizer_facts(),
            "document_separator": self.separator,
            "block_size": self.block_size,
            "train_tokens": self.train_tokens,
            "val_tokens": self.val_tokens,
            "val_windows": self.val_windows,
            "unigram_val_loss": self.unigram_val_loss,
            "not_utf8_bytes": self.not_utf8_bytes,
        }

    def _tokenizer_facts(self) -> dict[str, Any] | None:
        vocab = self.vocabulary
        if vocab.tokenizer is None:
            return None
        return {
            "file": self.tokenizer_file,
            "sha256": tokenizer_sha256(vocab.tokenizer),
            "end_of_text": vocab.end_of_text,
        }

    @property
    def identity(self) -> str:
        """The data's identity (:attr:`mptrain.data.batches.DataBundle.identity`): the digest of
        the text read, and with a tokenizer of the text and the tokenizer file together, so a
        resume refuses other text or another tokenizer (the same ids would mean other text)."""
        content, tokenizer = self.corpus.content_sha256, self.vocabulary.tokenizer
        if tokenizer is None:
            return f"sha256:{content}"
        both = f"{content}\ntokenizer {tokenizer_sha256(tokenizer)}"
        return f"sha256:{hashlib.sha256(both.encode()).hexdigest()}"


def _storage(tokens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, str]:
    """Tokens on the training device when they are small enough (they are read every step)."""
    if device.type == "cuda" and tokens.nbytes > MAX_DEVICE_RESIDENT_BYTES:
        return tokens, "in host memory"
    return tokens.to(device), "on the GPU" if device.type == "cuda" else "in memory"


class TrainWindows:
    """Training batches of ``batch_size`` windows at random offsets of the training tokens.

    An epoch is ``len(tokens) // block_size`` windows (one pass over the tokens, in expectation),
    split over the ``world`` ranks. Each (seed, rank, epoch) has its own generator, so epochs differ,
    reruns repeat, and a resumed run sees the batches an uninterrupted one would.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        device: torch.device,
        *,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.tokens, where = _storage(tokens, device)
        self.device, self.block_size, self.batch_size = device, block_size, batch_size
        self.seed, self.rank = seed, rank
        self.num_batches = (len(tokens) // block_size) // (batch_size * world)
        self.feed = f"random token windows ({where})"

    def __len__(self) -> int:
        return self.num_batches

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = epoch_generator(self.seed + self.rank, epoch, ORDER_STREAM, self.tokens.device)
        for _ in range(self.num_batches):
            inputs, targets = random_windows(
                self.tokens, self.block_size, self.batch_size, generator
            )
            yield inputs.to(self.device), targets.to(self.device)


class ValWindows:
    """The fixed validation windows, in order, in batches of ``batch_size``; rank ``rank`` of
    ``world`` evaluates every ``world``-th window."""

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        max_windows: int,
        batch_size: int,
        device: torch.device,
        *,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        stored, where = _storage(tokens, device)
        inputs, targets = fixed_windows(stored, block_size, max_windows)
        self.windows = len(inputs)
        self.inputs, self.targets = inputs[rank::world], targets[rank::world]
        self.device, self.batch_size = device, batch_size
        self.num_batches = -(-len(self.inputs) // batch_size)
        self.feed = f"fixed token windows ({where})"

    def __len__(self) -> int:
        return self.num_batches

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in range(self.num_batches):
            window = slice(b * self.batch_size, (b + 1) * self.batch_size)
            yield self.inputs[window].to(self.device), self.targets[window].to(self.device)


@dataclass(frozen=True)
class TokenText:
    """A text read and tokenised: its tokens, what was read, and the vocabulary."""

    tokens: torch.Tensor
    corpus: CorpusFacts
    vocabulary: Vocabulary
    val_fraction: float  # the share of the tokens, at the end, that validates
    # Character vocabulary: bytes that are not UTF-8 (each read as U+FFFD); None: bytes vocabulary.
    not_utf8_bytes: int | None = None
    left_unread: bool = False  # reading stopped at max_bytes with text left
    separator: str | None = None  # what joined the documents of .jsonl/.parquet files


# One lone surrogate per byte that is not part of valid UTF-8 (errors="surrogateescape").
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def count_not_utf8(data: bytes) -> int:
    """How many bytes of ``data`` are not part of a valid UTF-8 sequence."""
    return len(_NOT_UTF8.findall(data.decode("utf-8", errors="surrogateescape")))


def read_text_dataset(
    path: str,
    max_bytes: int,
    suffix: str | None,
    vocabulary: str,
    val_fraction: float,
    *,
    tokenizer: str | None = None,
    text_field: str = "text",
) -> TokenText:
    """Read ``path`` (a file or directory, its ``.txt`` files unless ``suffix`` says; empty: the
    interpreter's standard library, its ``.py`` files) and tokenise it with a byte or a character
    vocabulary (:meth:`Vocabulary.of_characters`), or with ``tokenizer`` (a ``tokenizer.json``'s
    content; ``vocabulary`` is then not used). Characters and tokenizers read UTF-8: the bytes
    that are not are counted (``not_utf8_bytes``). The records of ``.jsonl``/``.parquet`` files
    are joined with :func:`document_separator`. FileNotFoundError when there is no text,
    BadRecord for a record without text."""
    root = Path(path) if path else stdlib_root()
    suffix = suffix or (".txt" if path else ".py")
    vocab = None if tokenizer is None else Vocabulary(tokenizer=tokenizer)
    separator = document_separator(vocab)
    data, facts, left_unread = _read_source(root, max_bytes, suffix, text_field, separator)
    if not path:
        facts = dataclasses.replace(facts, source=f"python stdlib {root}")
    if vocab is None and vocabulary == "chars":
        text = data.decode("utf-8", errors="replace")
        vocab = Vocabulary.of_characters(text)
    vocab = vocab or Vocabulary()
    not_utf8 = None if vocab.kind == "bytes" else count_not_utf8(data)
    joined_by = None if facts.documents is None else separator
    return TokenText(
        vocab.encode(data), facts, vocab, val_fraction, not_utf8, left_unread, joined_by
    )


def document_separator(vocab: Vocabulary | None) -> str:
    """What ends each document of a ``.jsonl``/``.parquet`` file: the tokenizer's end-of-text
    token when it has one (so the model learns where a document ends, as GPT-2 was trained), else
    a blank line, which byte and character vocabularies, and tokenizers without such a token,
    read as ordinary text."""
    return (vocab.end_of_text if vocab is not None else None) or PLAIN_DOCUMENT_SEPARATOR
