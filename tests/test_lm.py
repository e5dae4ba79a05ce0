"""The language-model pieces (issue 17, first part): the GPT model and the embedded text corpus."""

from __future__ import annotations

import pytest
import torch

from mptrain.gpt import GPT, GPTShape
from mptrain.text import (
    Vocabulary,
    corpus_files,
    fixed_windows,
    random_windows,
    read_corpus,
    split_tokens,
    stdlib_root,
)

SMALL = GPTShape(vocab_size=256, block_size=16, layers=2, heads=2, width=32)


def test_no_position_sees_the_future():
    """Changing the token at position t changes no logit before t, and changes logits from t on."""
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    ids = torch.randint(0, 256, (2, 16))
    for t in (0, 7, 15):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        with torch.no_grad():
            before, after = model(ids), model(changed)
        torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
        assert not torch.allclose(before[:, t:], after[:, t:])


def test_shapes_tied_head_and_too_long_input():
    model = GPT(SMALL)
    assert model(torch.zeros(3, 10, dtype=torch.long)).shape == (3, 10, 256)
    assert model.head.weight is model.tok_emb.weight
    with pytest.raises(ValueError, match="block_size is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTShape(width=30, heads=4)


def test_the_stdlib_corpus_is_deterministic_capped_and_recorded():
    first, facts = read_corpus(stdlib_root(), max_bytes=300_000)
    again, facts_again = read_corpus(stdlib_root(), max_bytes=300_000)
    assert first == again and facts == facts_again
    assert 0 < facts.bytes == len(first) <= 300_000 and facts.files > 1
    files = corpus_files(stdlib_root())
    names = [str(p.relative_to(stdlib_root())) for p in files]
    assert names == sorted(names) and names[0] == facts.first_file
    assert not any("site-packages" in n or "/test/" in f"/{n}" for n in names)


def test_a_single_file_is_read_and_cut_at_the_cap(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 100)
    data, facts = read_corpus(text, max_bytes=1000, suffix=".txt")
    assert len(data) == 1000 and facts.files == 1 and facts.first_file == "input.txt"


def test_byte_and_character_vocabularies_round_trip():
    data = "def f(x):\n    return x  # é\n".encode()
    assert Vocabulary().decode(Vocabulary().encode(data)) == data.decode()
    chars = Vocabulary.of_characters(data.decode())
    assert chars.size == len(set(data.decode())) + 1  # and the unknown character
    assert chars.decode(chars.encode(data)) == data.decode()
    assert chars.encode("€".encode()).tolist() == [0]  # not in the training text


def test_training_and_validation_windows_never_overlap():
    tokens = torch.arange(1000)  # each token is its own position
    split = split_tokens(tokens, val_fraction=0.1, block_size=16)
    assert len(split.train) == 900 and len(split.val) == 100
    x, y = random_windows(split.train, 16, 500, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (500, 16) and int(y.max()) < 900
    assert torch.equal(y, x + 1)  # the next token of every input
    vx, vy = fixed_windows(split.val, 16, max_windows=100)
    assert len(vx) == 6 and int(vx.min()) >= 900  # (100 - 1) // 16 whole windows
    assert torch.equal(vy, vx + 1) and int(vy.max()) < 1000
    assert torch.equal(vx, fixed_windows(split.val, 16, 100)[0])  # the same every time
    with pytest.raises(ValueError, match="validation text has 5 tokens"):
        split_tokens(torch.arange(100), val_fraction=0.05, block_size=16)
