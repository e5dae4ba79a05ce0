"""Language-model text in the formats people have: records of JSON Lines and Parquet files, and
a tokenizer file (the Hugging Face ``tokenizers`` library) beside the byte and character
vocabularies. Every file is made here, offline: the tokenizers are trained on a tiny text."""

from __future__ import annotations

import hashlib
import json

import pytest
from support.datafiles import CPU

from mptrain.config.base import ConfigError
from mptrain.config.data import TextDatasetConfig
from mptrain.data.batches import BatchLayout
from mptrain.data.build import build_data
from mptrain.data.text import Vocabulary

tokenizers = pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

DOCS = [
    f"document {i}: the quick brown fox jumps over the lazy dog. naïve café €" for i in range(200)
]


def write_tokenizer(path, *, end_of_text: bool = True, vocab_size: int = 300):
    """A byte-level BPE ``tokenizer.json`` trained on :data:`DOCS` (GPT-2's scheme, small)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"] if end_of_text else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


def write_jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path, docs=DOCS, row_group_size=50):
    pq.write_table(
        pa.table({"text": docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size
    )
    return path


def join_records(*args, **kwargs):
    """:func:`mptrain.data.records.join_records` (imported here: the module is new)."""
    from mptrain.data.records import join_records as join

    return join(*args, **kwargs)


def build_text(path, block_size: int = 16, **keys):
    layout = BatchLayout(2, 4, CPU, seed=0, num_workers=0, sequence_length=block_size)
    return build_data(TextDatasetConfig(path=str(path), **keys), layout)


# ------------------------------------------------------------------------------ JSONL and Parquet
def test_jsonl_and_parquet_records_are_joined_in_order_with_a_blank_line(tmp_path):
    expected = "\n\n".join(DOCS).encode()
    for path in (write_jsonl(tmp_path / "d.jsonl"), write_parquet(tmp_path / "d.parquet")):
        bundle = build_text(path)
        facts = bundle.text.describe()
        assert (facts["documents"], facts["bytes"]) == (200, len(expected))
        assert facts["content_sha256"] == hashlib.sha256(expected).hexdigest()
        assert facts["document_separator"] == "\n\n" and facts["vocabulary"] == "bytes"
        assert "200 documents" in bundle.description
    # Another field; a directory of them, in sorted order, with dataset.suffix.
    write_jsonl(tmp_path / "other.jsonl", DOCS[:3], field="content")
    assert build_text(tmp_path / "other.jsonl", text_field="content").text.corpus.documents == 3
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", DOCS[100:])
    write_jsonl(folder / "a.jsonl", DOCS[:100])
    bundle = build_text(folder, suffix=".jsonl")
    assert bundle.text.corpus.content_sha256 == hashlib.sha256(expected).hexdigest()
    assert (bundle.text.corpus.files, bundle.text.corpus.first_file) == (2, "a.jsonl")


def test_records_stop_at_max_bytes_without_reading_the_rest(tmp_path, monkeypatch):
    """Whole documents until max_bytes; Parquet is read batch by batch and no further."""
    path = write_parquet(tmp_path / "big.parquet", DOCS * 50, row_group_size=1000)  # 10,000 rows
    batches = []
    original = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            batches.append(len(batch))
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    data = join_records([path], "text", "\n\n", max_bytes=5_000)
    assert data.left_unread and len(data.data) <= 5_000
    assert data.data.decode() == "\n\n".join((DOCS * 50)[: data.documents])
    assert len(batches) == 1 and batches[0] < 10_000  # one batch of rows, not the file
    # JSONL: lines after the stop are not read, so a bad line there is not seen either.
    lines = write_jsonl(tmp_path / "d.jsonl", DOCS[:5])
    lines.write_text(lines.read_text() + "not json\n")
    assert join_records([lines], "text", "\n\n", max_bytes=200).documents < 5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"d.jsonl line 3: not JSON"),
        (
            '{"body": "x"}',
            r"d.jsonl line 3: no field 'text' \(its fields: 'body'\); set dataset.text_field",
        ),
        ('{"text": 7}', r"d.jsonl line 3: field 'text' is a int, not a string"),
        ('["text"]', r"d.jsonl line 3: a JSON list, not an object with 'text'"),
    ],
)
def test_a_bad_jsonl_line_is_one_line_naming_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(f'{{"text": "a"}}\n\n{line}\n')  # the blank line 2 is skipped, not an error
    with pytest.raises(ConfigError, match=r"^dataset.path='\S+': \S+" + message) as caught:
        build_text(path)
    assert "\n" not in str(caught.value)


def test_a_bad_parquet_file_names_file_column_and_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(ConfigError, match=r"d.parquet: no column 'text' \(its columns: 'body'\)"):
        build_text(path)
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(ConfigError, match=r"d.parquet: column 'text' holds int64, not strings"):
        build_text(path)
    pq.write_table(pa.table({"text": ["a", None]}), path)
    with pytest.raises(ValueError, match=r"d.parquet row 2: field 'text' is null"):
        join_records([path], "text", "\n\n", 1000)


def test_text_field_on_plain_text_is_refused_not_ignored(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("plain text\n" * 100)
    with pytest.raises(ConfigError, match=r"dataset.text_field='body': names the field of .jsonl"):
        build_text(path, text_field="body")


# ------------------------------------------------------------------------------------ tokenizers
def test_a_tokenizer_file_tokenises_the_text_and_the_report_names_it(tmp_path):
    tok = write_tokenizer(tmp_path / "tokenizer.json")
    bundle = build_text(write_jsonl(tmp_path / "d.jsonl"), tokenizer=str(tok))
    vocab, facts = bundle.text.vocabulary, bundle.text.describe()
    assert vocab.kind == "tokenizer" and bundle.num_classes == vocab.size == facts["vocab_size"]
    assert facts["vocabulary"] == "tokenizer"
    assert facts["tokenizer"] == {
        "file": str(tok),
        "sha256": hashlib.sha256(tok.read_bytes()).hexdigest(),
        "end_of_text": "<|endoftext|>",
    }
    # Documents end with the end-of-text token, one id each; the ids decode to the text.
    eot = tokenizers.Tokenizer.from_file(str(tok)).token_to_id("<|endoftext|>")
    assert int((bundle.train.tokens == eot).sum()) > 100
    text = vocab.decode(bundle.train.tokens)
    assert text.startswith(DOCS[0] + "<|endoftext|>" + DOCS[1])
    assert len(bundle.train.tokens) < 0.6 * len(text.encode())  # merges: fewer tokens than bytes
    assert vocab.decode(vocab.encode("naïve café €".encode())) == "naïve café €"
    # Without an end-of-text token the documents are joined with a blank line.
    plain = write_tokenizer(tmp_path / "plain.json", end_of_text=False)
    facts = build_text(tmp_path / "d.jsonl", tokenizer=str(plain)).text.describe()
    assert facts["document_separator"] == "\n\n" and facts["tokenizer"]["end_of_text"] is None


def test_the_data_identity_changes_with_the_tokenizer(tmp_path):
    text = write_jsonl(tmp_path / "d.jsonl")
    one = write_tokenizer(tmp_path / "one.json", vocab_size=300)
    two = write_tokenizer(tmp_path / "two.json", vocab_size=280)
    identities = {
        build_text(text, tokenizer=str(one)).identity,
        build_text(text, tokenizer=str(two)).identity,
        build_text(text).identity,
    }
    assert len(identities) == 3 and all(i.startswith("sha256:") for i in identities)
    assert (
        build_text(text, tokenizer=str(one)).identity
        == build_text(text, tokenizer=str(one)).identity
    )


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"tokenizer": "nowhere.json"},
            r"dataset.tokenizer='nowhere.json': nowhere.json does not exist",
        ),
        (
            {"tokenizer": "BAD"},
            r"dataset.tokenizer='\S+bad.json': \S+bad.json: not a tokenizer.json",
        ),
        (
            {"tokenizer": "GOOD", "vocabulary": "chars"},
            r"dataset.vocabulary='chars': left at bytes",
        ),
    ],
)
def test_a_tokenizer_that_cannot_be_used_is_one_line(tmp_path, monkeypatch, keys, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    good = write_tokenizer(tmp_path / "good.json")
    named = {"BAD": str(tmp_path / "bad.json"), "GOOD": str(good)}
    keys = {k: named.get(v, v) for k, v in keys.items()}
    with pytest.raises(ConfigError, match=message):
        cfg = TextDatasetConfig(path=str(write_jsonl(tmp_path / "d.jsonl")), **keys)
        cfg.validate()
        build_text(cfg.path, **keys)


def test_a_tokenizer_vocabulary_round_trips_through_a_checkpoint(tmp_path):
    from mptrain.commands.sample import TextStream

    vocab = Vocabulary(tokenizer=write_tokenizer(tmp_path / "t.json").read_text())
    again = Vocabulary.of_checkpoint(json.loads(json.dumps(vocab.checkpoint_facts())))
    assert again == vocab and again.kind == "tokenizer" and "tokenizer" not in repr(vocab)
    assert Vocabulary.of_checkpoint({"vocabulary": None}) == Vocabulary()  # older checkpoints
    # Streamed token by token, the pieces are the text decoded at once (é and € span tokens).
    ids = vocab.encode("naïve café € fox".encode()).tolist()
    stream = TextStream(vocab)
    pieces = [stream.piece([i]) for i in ids]
    assert "".join(pieces) + stream.end() == vocab.decode(ids) == "naïve café € fox"
    assert "\ufffd" not in "".join(pieces)
