"""The Python API as ``import mptrain`` offers it (issue 39, item 7): what ``dir(mptrain)`` and
``help(mptrain)`` show, ``mptrain.load_report`` of a path given as str or a run directory,
``Vocabulary.encode`` of text, ``mptrain.generate`` (the Python form of ``mptrain sample``), and
every ``python`` block of docs/python-api.md and docs/language-models.md run as written.

One tiny language model and one tiny digits classifier are trained in-process, once, where the
pages' commands put them (``runs/lm``, ``outputs/digits-run``); generation is otherwise checked on
an untrained tiny GPT.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.runs import LM, compose_run, tiny_lm, tiny_run, train

import mptrain
from mptrain.commands.sample import sample_main
from mptrain.config.base import ConfigError
from mptrain.data.text import UnknownCharacters, Vocabulary
from mptrain.models.gpt import GPT
from mptrain.report.schema import ReportError, RunReport

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [DOCS / "python-api.md", DOCS / "language-models.md"]
API = {"load_model", "load_model_info", "load_report", "preprocess", "generate"}


# ------------------------------------------------------------------------ what `mptrain` shows
def test_dir_help_and_all_show_the_api_without_importing_torch():
    code = (
        "import sys, mptrain\n"
        "names = set(dir(mptrain))\n"
        "assert 'torch' not in sys.modules\n"
        "print(sorted(mptrain.__all__)); print(sorted(names & set(mptrain.__all__)))\n"
        "print(mptrain.__doc__ is not None and all(n in mptrain.__doc__ for n in mptrain.__all__))\n"
        "mptrain.load_report\n"  # the report's reader needs no torch either
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    exported, shown, documented = result.stdout.splitlines()
    assert set(eval(exported)) == API and set(eval(shown)) == API
    assert documented == "True"


def test_help_lists_each_function_with_its_signature():
    text = re.sub(".\b", "", __import__("pydoc").render_doc(mptrain))
    assert "FUNCTIONS" in text
    for name in API:
        assert re.search(rf"^    {name}( = \w+)?\(", text, re.M), (
            name
        )  # an alias: "generate = generate_text("
    assert "generate(model" in text and "load_report(path" in text


def test_an_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'load_modle'"):
        mptrain.load_modle  # noqa: B018


# ----------------------------------------------------------------------------------- reports
def test_load_report_refuses_what_is_not_a_report_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nowhere'}: no such file")):
        mptrain.load_report(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path}: no report.json in")):
        mptrain.load_report(str(tmp_path))
    bad = tmp_path / "report.json"
    for content, words in (("{", "not JSON"), ("[1]", "not a JSON object"), ("\xff", "not JSON")):
        bad.write_bytes(content.encode("latin-1"))
        with pytest.raises(ReportError) as raised:
            mptrain.load_report(tmp_path)
        message = str(raised.value)
        assert message.startswith(f"{bad}: ") and words in message and "\n" not in message


# ------------------------------------------------------------------------------ vocabularies
def test_encode_takes_text_as_decode_gives_it():
    for vocab in (Vocabulary(), Vocabulary.of_characters("def é(x):\n")):
        for text in ("def ", "def é(x):\n"):
            ids = vocab.encode(text)
            assert torch.equal(ids, vocab.encode(text.encode("utf-8")))  # bytes: as before
            assert ids.dtype == torch.int64 and vocab.decode(ids) == text
    assert Vocabulary().encode("é").tolist() == [0xC3, 0xA9]  # a bytes vocabulary: its UTF-8
    assert Vocabulary().encode(b"\xff").tolist() == [255]  # bytes that are not UTF-8: as they are
    with pytest.raises(UnknownCharacters):
        Vocabulary.of_characters("abc").encode("abZ")


def test_a_tokenizer_vocabulary_encodes_text(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=alphabet)
    tok.train_from_iterator(["def f(x): return x  # café"] * 20, trainer)
    vocab = Vocabulary(tokenizer=tok.to_str())
    text = "def g(y): café"
    ids = vocab.encode(text)
    assert torch.equal(ids, vocab.encode(text.encode("utf-8"))) and vocab.decode(ids) == text


# ---------------------------------------------------------------------------- mptrain.generate
def command_output(monkeypatch, model: GPT, *args: str) -> str:
    """``mptrain sample`` in-process with ``model`` as the checkpoint's: its stdout."""
    monkeypatch.setattr("mptrain.commands.evaluate.load_model", lambda *a, **k: model)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    sample_main(["resume=tiny.pt", "device=cpu", *args])
    monkeypatch.undo()
    return out.getvalue()


@pytest.mark.parametrize("vocab", [Vocabulary(), Vocabulary.of_characters("the quick fox\n")])
def test_generate_gives_what_the_command_prints(monkeypatch, vocab):
    model = tiny_lm(vocab)
    for settings in (
        {"max_new_tokens": 12, "temperature": 0.0, "top_k": None, "seed": 0},
        {"max_new_tokens": 30, "temperature": 1.5, "top_k": None, "seed": 3},
        {"max_new_tokens": 9, "temperature": 0.8, "top_k": 4, "seed": -5},
    ):
        args = [f"{key}={'null' if value is None else value}" for key, value in settings.items()]
        printed = command_output(monkeypatch, model, "prompt=the ", *args)
        assert mptrain.generate(model, "the ", **settings) + "\n" == printed
    # The defaults are the command's (the config's sample block, seed 0).
    assert mptrain.generate(model, "the ") + "\n" == command_output(
        monkeypatch, model, "prompt=the "
    )


def test_generate_is_reproducible_by_seed_and_starts_with_the_prompt():
    model = tiny_lm(Vocabulary())
    first = mptrain.generate(model, "def ", max_new_tokens=40, temperature=2.0, seed=1)
    assert first == mptrain.generate(model, "def ", max_new_tokens=40, temperature=2.0, seed=1)
    assert first != mptrain.generate(model, "def ", max_new_tokens=40, temperature=2.0, seed=2)
    assert first.startswith("def ")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_new_tokens": 0}, "sample.max_new_tokens=0: must be an integer >= 1"),
        ({"temperature": -1.0}, "sample.temperature=-1.0: must be >= 0"),
        ({"top_k": 0}, "sample.top_k=0: must be an integer >= 1"),
        ({"seed": 2**64}, "seed=18446744073709551616: must fit in 64 bits"),
        ({"prompt": ""}, "prompt: empty"),
        ({"prompt": "Zebra"}, "'Z', 'a', 'b', 'r' not among the"),
    ],
)
def test_generate_refuses_settings_out_of_range_in_one_line(changes, message):
    model = tiny_lm(Vocabulary.of_characters("the quick fox\n"))
    arguments = {"prompt": "the ", "max_new_tokens": 3} | changes
    with pytest.raises(ConfigError) as raised:
        mptrain.generate(model, **arguments)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_generate_refuses_a_classifier():
    classifier = torch.nn.Linear(4, 2)
    classifier.mptrain_vocabulary, classifier.mptrain_checkpoint = None, "run/best.pt"
    with pytest.raises(ConfigError, match=r"run/best\.pt: an image classifier; generate needs"):
        mptrain.generate(classifier, "the ")
    with pytest.raises(ConfigError, match=r"not a model of mptrain\.load_model"):
        mptrain.generate(torch.nn.Linear(4, 2), "the ")


# ---------------------------------------------------------------------- the pages, as written
@pytest.fixture(scope="module")
def launch_dir(tmp_path_factory) -> Path:
    """A directory holding the runs the pages' commands make: ``runs/lm`` (a tiny language
    model) and ``outputs/digits-run`` (a tiny digits classifier)."""
    cwd = tmp_path_factory.mktemp("pages")
    lm = compose_run(*LM, "precision=fp32", "max_steps=10", "eval_every=10")
    train(lm, cwd / "runs" / "lm")
    train(tiny_run("max_steps=3", "epochs=null", "precision=fp32"), cwd / "outputs" / "digits-run")
    return cwd


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)


def test_the_pages_show_the_python_api():
    blocks = "".join(python_blocks(DOCS / "language-models.md"))
    for call in ("mptrain.generate(", "mptrain.load_model(", ".encode(", ".decode("):
        assert call in blocks, call
    assert "mptrain.load_report(" in "".join(python_blocks(DOCS / "python-api.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_python_block_of_the_page_runs_as_written(launch_dir, page, monkeypatch, capsys):
    monkeypatch.chdir(launch_dir)
    for block in python_blocks(page):
        exec(block, {})
    assert capsys.readouterr().out  # each block prints what it shows


def test_load_report_takes_a_str_a_run_directory_or_its_report_json(launch_dir):
    run = launch_dir / "runs" / "lm"
    reports = [mptrain.load_report(p) for p in (str(run), run, str(run / "report.json"))]
    assert all(isinstance(r, RunReport) for r in reports)
    assert reports[0] == reports[1] == reports[2]
    assert reports[0].to_dict() == json.loads((run / "report.json").read_text())
    assert reports[0].evaluation.task == "lm"
