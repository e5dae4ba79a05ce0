"""Documents stored as records: JSON Lines (``.jsonl``, one JSON object per line) and Parquet
(``.parquet``, read with pyarrow), each record's text in one field (``dataset.text_field``).

Records are streamed in file order and reading stops at ``max_bytes`` (:func:`join_records`): a
large file is never loaded whole, and what lies beyond ``max_bytes`` is neither read nor checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RECORD_SUFFIXES = (".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 1024  # rows per pyarrow batch: bounded memory whatever the file's size


class BadRecord(ValueError):
    """A record of a ``.jsonl`` or ``.parquet`` file that holds no text in the field asked for;
    the message names the file, the line or row (1-based) and the field."""


class MissingReader(ImportError):
    """The library that reads this format is not installed; the message says what to install."""


def jsonl_texts(path: Path, field: str) -> Iterator[str]:
    """The ``field`` of each line's JSON object, in order; blank lines are skipped (a trailing
    newline is common). BadRecord for a line that holds no text in ``field``."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                raise BadRecord(f"{where}: not JSON ({exc})") from None
            yield _text_of(record, field, where)


def _text_of(record: object, field: str, where: str) -> str:
    """``record[field]`` when ``record`` is a JSON object whose ``field`` is a string."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where}: a JSON {type(record).__name__}, not an object with {field!r}")
    if field not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise BadRecord(f"{where}: no field {field!r} (its fields: {keys}); set dataset.text_field")
    text = record[field]
    if not isinstance(text, str):
        raise BadRecord(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
    return text


def parquet_texts(path: Path, field: str) -> Iterator[str]:
    """The ``field`` column's values, row by row, read in batches of rows. BadRecord when the
    file lacks the column, the column is not text, or a value is null; MissingReader without
    pyarrow."""
    try:
        import pyarrow.parquet as pq
        import pyarrow.types as pa_types
    except ImportError:
        raise MissingReader(
            f"{path}: reading Parquet needs pyarrow: pip install 'mptrain[parquet]'"
        ) from None
    table = pq.ParquetFile(path)
    schema = table.schema_arrow
    if schema.get_field_index(field) < 0:
        names = ", ".join(map(repr, schema.names[:8])) or "none"
        raise BadRecord(
            f"{path}: no column {field!r} (its columns: {names}); set dataset.text_field"
        )
    kind = schema.field(field).type
    if not (pa_types.is_string(kind) or pa_types.is_large_string(kind)):
        raise BadRecord(f"{path}: column {field!r} holds {kind}, not strings")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise BadRecord(f"{path} row {row}: field {field!r} is null")
            yield text


@dataclass(frozen=True)
class JoinedRecords:
    """The documents taken: their text joined, the files they came from, how many there were,
    and whether text was left unread at ``max_bytes``."""

    data: bytes
    files: list[Path]
    documents: int
    left_unread: bool


def join_records(files: list[Path], field: str, separator: str, max_bytes: int) -> JoinedRecords:
    """Whole documents of ``files``, in order, each followed by ``separator`` except the last,
    until the next would pass ``max_bytes`` (a first document longer than that is cut there, as a
    single plain-text file is). Stops reading there: later records are neither read nor checked."""
    sep = separator.encode()
    chunks: list[bytes] = []
    used: list[Path] = []
    total = documents = 0
    for path in files:
        texts = parquet_texts if path.suffix.lower() == ".parquet" else jsonl_texts
        for text in texts(path, field):
            data = (sep if documents else b"") + text.encode("utf-8", errors="surrogatepass")
            if documents and total + len(data) > max_bytes:
                return JoinedRecords(b"".join(chunks), used, documents, True)
            chunks.append(data[: max_bytes - total])
            total += len(chunks[-1])
            documents += 1
            if not used or used[-1] != path:
                used.append(path)
            if len(data) > len(chunks[-1]):
                return JoinedRecords(b"".join(chunks), used, documents, True)
    return JoinedRecords(b"".join(chunks), used, documents, False)
