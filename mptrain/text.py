"""Text for language modelling: the embedded corpus, tokens, and the windows a model trains on.

The default corpus needs no download: the source files of the Python standard library that ships
with the running interpreter (``sysconfig``'s ``stdlib`` path), read in sorted path order, test
suites and site-packages left out, until ``max_bytes``. Any local text file or directory
(``path``) can be read the same way. What was read is recorded (:class:`CorpusFacts`), so a report
can say which files and how many bytes a model saw.

Tokens are bytes (vocabulary 256, no tokenizer) or characters (a vocabulary built from the
training text; a character only the validation text has maps to the reserved id 0). The token
stream is split once: the first ``1 - val_fraction`` of it trains, the rest validates, and no
window crosses the boundary, so no validation token is ever seen in training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Directories of the standard library that are test suites or third-party code, not the library.
_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
UNKNOWN_CHAR = "\x00"  # id 0 of a character vocabulary: characters the training text lacks


@dataclass(frozen=True)
class CorpusFacts:
    """What was read: where from, how many files and bytes, and a digest of the file list."""

    source: str  # "python stdlib <version dir>" or the path given
    files: int
    bytes: int
    file_list_sha256: str  # of the newline-joined relative paths, in reading order
    first_file: str | None
    last_file: str | None


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


def read_corpus(root: Path, max_bytes: int, suffix: str = ".py") -> tuple[bytes, CorpusFacts]:
    """The concatenated files of ``root`` (whole files, in order, until ``max_bytes``; a single
    file is cut at ``max_bytes``) and what was read."""
    files = corpus_files(root, suffix)
    if not files:
        raise FileNotFoundError(f"{root}: no {suffix} files to read")
    chunks, used, total = [], [], 0
    for path in files:
        data = path.read_bytes()
        if total and total + len(data) > max_bytes:
            break
        chunks.append(data[: max_bytes - total])
        used.append(path)
        total += len(chunks[-1])
    names = [str(p.relative_to(root)) if p != root else p.name for p in used]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    facts = CorpusFacts(str(root), len(used), total, digest, names[0], names[-1])
    return b"".join(chunks), facts


@dataclass(frozen=True)
class Vocabulary:
    """Token ids for bytes (``chars`` None: id = byte value) or for characters."""

    chars: str | None = None

    @property
    def size(self) -> int:
        return 256 if self.chars is None else len(self.chars)

    @classmethod
    def of_characters(cls, text: str) -> Vocabulary:
        """Every character of ``text``, sorted, after the reserved unknown character (id 0)."""
        return cls(UNKNOWN_CHAR + "".join(sorted(set(text) - {UNKNOWN_CHAR})))

    def encode(self, data: bytes) -> torch.Tensor:
        if self.chars is None:
            return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
        index = {c: i for i, c in enumerate(self.chars)}
        text = data.decode("utf-8", errors="replace")
        return torch.tensor([index.get(c, 0) for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.chars is None:
            return bytes(values).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in values)


@dataclass(frozen=True)
class TokenSplit:
    """The token stream split once: ``train`` then ``val``, never overlapping."""

    train: torch.Tensor
    val: torch.Tensor


def split_tokens(tokens: torch.Tensor, val_fraction: float, block_size: int) -> TokenSplit:
    """The first ``1 - val_fraction`` of ``tokens`` for training, the rest for validation; each
    part must hold at least one window of ``block_size + 1`` tokens (inputs and next tokens)."""
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < block_size + 1:
            raise ValueError(
                f"the {name} text has {len(part)} tokens, fewer than one window of "
                f"block_size + 1 = {block_size + 1}"
            )
    return TokenSplit(train, val)


def random_windows(
    tokens: torch.Tensor, block_size: int, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows at random offsets: inputs ``(count, block_size)`` and next tokens."""
    starts = torch.randint(0, len(tokens) - block_size, (count,), generator=generator)
    rows = starts[:, None] + torch.arange(block_size + 1)
    windows = tokens[rows]
    return windows[:, :-1], windows[:, 1:]


def fixed_windows(
    tokens: torch.Tensor, block_size: int, max_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_windows`` consecutive, non-overlapping windows from the start of ``tokens``:
    the same validation set on every evaluation and every run."""
    count = min(max_windows, (len(tokens) - 1) // block_size)
    starts = torch.arange(count) * block_size
    rows = starts[:, None] + torch.arange(block_size + 1)
    windows = tokens[rows]
    return windows[:, :-1], windows[:, 1:]
