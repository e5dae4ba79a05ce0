"""mptrain sample's settings: composed like every command's (sample.*, seed, device,
eval.checkpoint), its short forms, and a prompt taken verbatim; what it refuses in one line
(temperatures, seeds, prompts, damaged weights) and how the text streams out, on an untrained
tiny GPT in place of a checkpoint. Generation from a trained model is tested in
tests/train/test_lm.py."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch
from support.runs import run_cli, tiny_lm

from mptrain.commands.sample import encode_prompt, sample_main, sample_settings
from mptrain.config.base import ConfigError
from mptrain.data.text import Vocabulary
from mptrain.models.gpt import GPT

CHARS = Vocabulary.of_characters("the quick brown fox\n")
BYTES = Vocabulary()  # chars None: a token is a byte


def test_short_forms_and_full_keys_compose_to_the_same_settings():
    short = ["resume=run", "max_new_tokens=5", "temperature=0", "top_k=null", "checkpoint=best"]
    full = [
        "resume=run",
        "sample.max_new_tokens=5",
        "sample.temperature=0",
        "sample.top_k=null",
        "eval.checkpoint=best",
    ]
    (a, _), (b, _) = sample_settings(short), sample_settings(full)
    assert a.sample == b.sample and a.eval == b.eval
    assert (a.sample.max_new_tokens, a.sample.temperature, a.sample.top_k) == (5, 0.0, None)
    assert a.eval.checkpoint == "best" and a.resume == "run"


def test_the_prompt_is_taken_verbatim():
    for prompt in ("def ", "f(a, b): [x] {y}", " lead", "a=b"):
        assert sample_settings(["resume=run", f"prompt={prompt}"])[1] == prompt
        assert sample_settings(["resume=run", f"sample.prompt={prompt}"])[1] == prompt
    assert sample_settings(["resume=run"])[1] == "\n"  # the config's default


def test_seed_and_device_are_the_run_keys():
    cfg, _ = sample_settings(["resume=run", "seed=7", "device=cpu"])
    assert (cfg.seed, cfg.device) == (7, "cpu")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prompt=x"], "resume: required"),
        (["resume=run", "temperature=-1"], "sample.temperature=-1.0: must be >= 0"),
        (["resume=run", "top_k=0"], "sample.top_k=0: must be an integer >= 1"),
        (["resume=run", "checkpoint=worst"], "eval.checkpoint='worst'"),
        (["resume=run", "colour=red"], "colour: unknown key"),
        (["resume=run", "hydra.run.dir=x"], "mptrain sample writes to stdout only"),
        (["resume=run", "--multirun"], "mptrain sample takes config overrides"),
    ],
)
def test_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=None) as raised:
        sample_settings(args)
    assert message in str(raised.value) and "\n" not in str(raised.value)


# ------------------------------------------------------- sampling, on an untrained tiny GPT


class Recorder(io.StringIO):
    """stdout that notes, at each write, how many forward passes the model had made."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.forwards, self.writes = 0, []
        model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def write(self, text: str) -> int:
        if text:
            self.writes.append((self.forwards, text))
        return super().write(text)


def sample_text(monkeypatch, model: GPT, *args: str) -> Recorder:
    """``mptrain sample`` in-process with ``model`` as the checkpoint's; its stdout."""
    monkeypatch.setattr("mptrain.commands.evaluate.load_model", lambda *a, **k: model)
    out = Recorder(model)
    monkeypatch.setattr(sys, "stdout", out)
    sample_main(["resume=tiny.pt", "device=cpu", *args])
    return out


def sample_refusal(monkeypatch, tmp_path, model: GPT, *args: str) -> str:
    """``mptrain sample`` through the command line's entry point: its one-line error (exit 2)."""
    monkeypatch.setattr("mptrain.commands.evaluate.load_model", lambda *a, **k: model)
    outcome = run_cli(["sample", "resume=tiny.pt", "device=cpu", *args], tmp_path, monkeypatch)
    assert outcome.code == 2, outcome.stderr
    error = outcome.stderr.splitlines()[-1]  # after the line saying what is sampled, if any
    assert error.startswith("mptrain: error: ") and "Traceback" not in outcome.stderr
    return error


@pytest.mark.parametrize("temperature", ["1e-30", "1e-300", "5e-324"])
def test_a_tiny_temperature_samples_the_most_likely_tokens(monkeypatch, temperature):
    """Issue 27, item 17: logits / 1e-300 overflowed (1e-300 is 0 in float32) to NaN
    probabilities; as the temperature nears 0 the draw nears the greedy choice."""
    greedy = sample_text(monkeypatch, tiny_lm(CHARS), "temperature=0", "max_new_tokens=20")
    tiny = sample_text(
        monkeypatch, tiny_lm(CHARS), f"temperature={temperature}", "max_new_tokens=20"
    )
    greedy, tiny = greedy.getvalue(), tiny.getvalue()
    assert tiny == greedy and len(greedy) > 10


def test_a_huge_temperature_draws_from_the_top_k(monkeypatch):
    """At temperature=inf every scaled logit rounds to 0: top_k still picks by the logits."""
    out = sample_text(
        monkeypatch, tiny_lm(CHARS), "temperature=inf", "top_k=1", "max_new_tokens=20"
    )
    greedy = sample_text(monkeypatch, tiny_lm(CHARS), "temperature=0", "max_new_tokens=20")
    assert out.getvalue() == greedy.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["temperature=nan"], "mptrain: error: sample.temperature=nan: must be >= 0"),
        ([f"seed={2**70}"], f"mptrain: error: seed={2**70}: must fit in 64 bits"),
    ],
)
def test_a_nan_temperature_and_a_seed_beyond_64_bits_are_one_line_errors(
    monkeypatch, tmp_path, args, message
):
    assert sample_refusal(monkeypatch, tmp_path, tiny_lm(CHARS), *args).startswith(message)


def test_prompt_bytes_that_are_not_utf8_are_refused_by_a_characters_vocabulary(
    monkeypatch, tmp_path
):
    """Issue 27, item 17: ``prompt=$'ab\\xff'`` reaches Python as a surrogate escape (PEP 383),
    which str.encode('utf-8') refused with a traceback."""
    error = sample_refusal(monkeypatch, tmp_path, tiny_lm(CHARS), "prompt=ab\udcff\nc")
    assert error.startswith("mptrain: error: sample.prompt=ab\\xff\\nc: not UTF-8 (byte 0xff")
    assert "dataset.vocabulary=chars" in error


def test_prompt_bytes_that_are_not_utf8_are_taken_as_bytes_by_a_bytes_vocabulary(monkeypatch):
    out = sample_text(monkeypatch, tiny_lm(BYTES), "prompt=ab\udcff", "max_new_tokens=3")
    assert out.getvalue().startswith("ab\ufffd")  # the byte 0xff, shown as U+FFFD


def test_a_model_whose_logits_are_not_finite_is_a_one_line_error(monkeypatch, tmp_path):
    model = tiny_lm(CHARS)
    with torch.no_grad():
        model.head.weight[3, 0] = math.nan
    error = sample_refusal(monkeypatch, tmp_path, model, "max_new_tokens=3")
    assert "resume=tiny.pt: the model's logits are not finite (NaN or inf) in tiny.pt" in error


def test_the_text_streams_out_as_each_token_is_chosen(monkeypatch):
    """Issue 27, "also": a huge max_new_tokens printed nothing until the end. Each token's text is
    written (and flushed) after the forward pass that chose it, before the next one."""
    out = sample_text(monkeypatch, tiny_lm(CHARS), "prompt=the", "max_new_tokens=12")
    assert out.writes[0] == (0, "the")
    assert [forwards for forwards, _ in out.writes[1:-1]] == list(range(1, 13))
    assert out.writes[-1] == (12, "\n")
    assert "".join(text for _, text in out.writes) == out.getvalue()


def test_streamed_bytes_decode_as_the_whole_text_does():
    """A bytes vocabulary spreads a character over several tokens: the stream holds its first
    bytes until it is complete, and ends an unfinished one with U+FFFD, as Vocabulary.decode."""
    from mptrain.commands.sample import TextStream

    stream = TextStream(BYTES)
    assert (stream.piece([0xC3]), stream.piece([0xA9]), stream.piece([0xE2, 0x82])) == ("", "é", "")
    assert stream.end() == "\ufffd"
    data = list("naïve €5 ".encode()) + list(torch.randint(0, 256, (300,), generator=None).tolist())
    stream = TextStream(BYTES)
    pieces = [stream.piece([b]) for b in data] + [stream.end()]
    assert "".join(pieces) == BYTES.decode(data)


# ------------------------------------------------ which checkpoint, and characters it never saw
def run_directory(tmp_path: Path, *, best: bool) -> Path:
    """A run directory's checkpoint files by name (sample_settings only looks for best.pt)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_00000010.pt").write_bytes(b"")
    if best:
        (checkpoints / "best.pt").write_bytes(b"")
    return tmp_path / "run"


@pytest.mark.parametrize(("best", "default"), [(True, "best"), (False, "latest")])
def test_sample_takes_best_pt_by_default_where_the_run_kept_one(tmp_path, best, default):
    """As nanoGPT's sample.py samples the best model its train.py kept; the command line wins."""
    run = run_directory(tmp_path, best=best)
    assert sample_settings([f"resume={run}"])[0].eval.checkpoint == default
    asked = sample_settings([f"resume={run}", "checkpoint=latest"])[0]
    assert asked.eval.checkpoint == "latest"
    assert sample_settings([f"resume={run}/checkpoints"])[0].eval.checkpoint == default


def test_stderr_names_the_checkpoint_and_why(monkeypatch, tmp_path, capsys):
    run = run_directory(tmp_path, best=True)
    model = tiny_lm(CHARS)
    monkeypatch.setattr("mptrain.commands.evaluate.load_model", lambda *a, **k: model)
    model.mptrain_checkpoint = str(run / "checkpoints" / "best.pt")
    sample_main([f"resume={run}", "device=cpu", "max_new_tokens=1", "prompt=the"])
    err = capsys.readouterr().err
    assert f"{run}/checkpoints/best.pt (best.pt: the best evaluation;" in err


def test_a_prompt_character_the_vocabulary_lacks_is_refused_naming_it(monkeypatch, tmp_path):
    """A character vocabulary has no unknown id (issue 29): the model has no id to read it as."""
    assert CHARS.unknown_id is None and CHARS.size == len(set("the quick brown fox\n"))
    error = sample_refusal(monkeypatch, tmp_path, tiny_lm(CHARS), "prompt=the Zoo€")
    assert "'Z', '€' not among the 17 characters the model was trained on" in error


def test_an_older_vocabulary_reads_unseen_characters_as_its_unknown_id():
    older = Vocabulary.of_checkpoint({"vocabulary": "\x00 abc", "tokenizer": None})
    assert older.unknown_id == 0
    ids, missing = encode_prompt(older, "a Zc")
    assert ids[0].tolist() == [2, 1, 0, 4] and missing == ["Z"]


class ReaderGoesAway(Recorder):
    """mptrain's stdout when ``| head -c 5`` closed the pipe after the prompt and two tokens."""

    reader_gone = False

    def write(self, text: str) -> int:
        written = super().write(text)
        self.reader_gone = len(self.writes) >= 3
        return written


def test_sampling_stops_when_the_reader_went_away(monkeypatch):
    """Issue 39, item 25: ``mptrain sample ... | head -c 5`` kept generating."""
    model = tiny_lm(CHARS)
    monkeypatch.setattr("mptrain.commands.evaluate.load_model", lambda *a, **k: model)
    out = ReaderGoesAway(model)
    monkeypatch.setattr(sys, "stdout", out)
    sample_main(["resume=tiny.pt", "device=cpu", "max_new_tokens=500", "temperature=0"])
    assert len(out.writes) == 3 and out.forwards <= 3  # not 500 forwards into the void
