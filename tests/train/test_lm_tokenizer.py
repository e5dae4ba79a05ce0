"""A language model trained with a tokenizer file on JSON Lines: the checkpoint carries the
tokenizer (``mptrain sample`` decodes with it after the file is gone), and a resume refuses a
different tokenizer."""

from __future__ import annotations

import json
import re

import pytest
from support.processes import describe, run_mptrain
from support.runs import LM, compose_run, train

from mptrain.checkpoint.file import check_compatible
from mptrain.commands.evaluate import load_model
from mptrain.commands.sample import encode_prompt, generate
from mptrain.config.base import ConfigError

pytest.importorskip("tokenizers")

LINE = "the quick brown fox jumps over the lazy dog"


def write_tokenizer(path, lowercase: bool = False) -> str:
    """A byte-level BPE ``tokenizer.json`` with an end-of-text token, trained on :data:`LINE`
    (``lowercase``: another tokenizer of the same size, which lowercases text first)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([f"{LINE} {i}" for i in range(50)], trainer)
    tok.save(str(path))
    return str(path)


def lm_run(tmp_path, *overrides: str):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"{LINE} {i % 10}"}) + "\n" for i in range(400)))
    return compose_run(
        *LM,
        f"dataset.path={docs}",
        f"dataset.tokenizer={tmp_path / 'tokenizer.json'}",
        "precision=fp32",
        "model.block_size=16",
        *overrides,
    )


@pytest.mark.slow
def test_a_tokenizer_run_samples_with_its_checkpoint_and_refuses_another_tokenizer(tmp_path):
    write_tokenizer(tmp_path / "tokenizer.json")
    run_dir = tmp_path / "run"
    steps = ("max_steps=60", "eval_every=60", "optimizer.lr=1e-2")
    report = train(lm_run(tmp_path, *steps), run_dir)
    text = report["data"]["text"]
    assert text["vocabulary"] == "tokenizer" and text["tokenizer"]["end_of_text"] == "<|endoftext|>"
    assert report["evaluation"]["final_val_loss"] < text["unigram_val_loss"]

    # Another tokenizer (of the same size) at the same path: the data identity differs, so the
    # resume is refused in one line.
    write_tokenizer(tmp_path / "tokenizer.json", lowercase=True)
    with pytest.raises(ConfigError, match=r"holds other data than \S+ was trained on"):
        train(lm_run(tmp_path, *steps, "resume=auto"), run_dir)

    # The checkpoint holds the tokenizer: sampling needs no file.
    (tmp_path / "tokenizer.json").unlink()
    model = load_model(run_dir)
    vocab = model.mptrain_vocabulary
    assert vocab.kind == "tokenizer" and vocab.size == text["vocab_size"]
    ids, _ = encode_prompt(vocab, "the quick")
    assert vocab.decode(generate(model, ids, 6, 16, temperature=0)[0]).startswith(
        "the quick brown fox"
    )
    result = run_mptrain(
        tmp_path,
        "sample",
        f"resume={run_dir}",
        "prompt=the quick",
        "temperature=0",
        "max_new_tokens=6",
    )
    assert result.returncode == 0, describe(result)
    assert result.stdout.startswith("the quick brown fox"), result.stdout


def test_a_text_checkpoint_from_before_text_field_still_resumes(tmp_path):
    """Signatures written before dataset.text_field existed read as its default ("text")."""
    signature = {"task": "lm", "dataset.name": "text", "dataset.text_field": "text"}
    old = {k: v for k, v in signature.items() if k != "dataset.text_field"}
    assert check_compatible({"signature": old}, signature, tmp_path, allow_changes=False) == []
    other = {**signature, "dataset.text_field": "body"}
    with pytest.raises(ConfigError, match=re.escape("dataset.text_field: checkpoint 'text'")):
        check_compatible({"signature": old}, other, tmp_path, allow_changes=False)
