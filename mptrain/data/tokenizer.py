"""Tokenizer files (``dataset.tokenizer``): a local ``tokenizer.json`` of the Hugging Face
``tokenizers`` library; nothing is downloaded. A run keeps the file's content, not its path: its
SHA-256 is in the report and the data's identity, and checkpoints store it whole
(docs/language-models.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

# Special tokens that end a document, by the names common tokenizers give them (GPT-2 and most
# byte-level BPEs; Llama 3; Llama 2, T5 and SentencePiece models; Gemma and others). The first
# one a tokenizer has as a special token separates the documents of JSONL and Parquet files.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be used; the message names the file and what is wrong."""


def read_tokenizer_file(path: Path) -> str:
    """The content of a ``tokenizer.json``, exactly as stored (its SHA-256 is the file's):
    FileNotFoundError when it does not exist, TokenizerFileError when it is not UTF-8 text or
    the ``tokenizers`` library cannot load it."""
    if path.is_dir():  # a model directory: the file inside is what people mean
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a tokenizer.json file")
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerFileError(f"{path}: not UTF-8 text; give a tokenizer.json file") from None
    parse_tokenizer(content, str(path))  # refuse it now, not when the first text is encoded
    return content


def parse_tokenizer(content: str, source: str = "the tokenizer") -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``'s content. ImportError naming the
    extra to install without the library; TokenizerFileError when the content is not one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "dataset.tokenizer needs the tokenizers library: pip install 'mptrain[tokenizers]'"
        ) from None
    try:
        return Tokenizer.from_str(content)
    except Exception as exc:  # the library raises a bare Exception for malformed files
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerFileError(
            f"{source}: not a tokenizer.json the tokenizers library reads ({first})"
        ) from None


def tokenizer_sha256(content: str) -> str:
    """SHA-256 of a tokenizer file's bytes (what ``sha256sum tokenizer.json`` prints)."""
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


def vocabulary_size(tokenizer: Any) -> int:
    """The number of token ids: one past the largest, added tokens included (ids a tokenizer
    leaves unused still get an embedding row, so every id it emits is in range)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def end_of_text(tokenizer: Any) -> str | None:
    """The first of :data:`END_OF_TEXT_TOKENS` the tokenizer holds as a special token, or None."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((token for token in END_OF_TEXT_TOKENS if token in special), None)
