"""``mptrain sample``: text from a trained language model, so a user sees what it learned
(docs/language-models.md lists its settings, their short forms and defaults).

    mptrain sample resume=RUN_DIR prompt="def " sample.max_new_tokens=200 sample.temperature=0.8

The model is rebuilt as :func:`mptrain.commands.evaluate.load_model` does and generates
autoregressively (:func:`choose_next`, :func:`new_tokens`). The prompt and each new token's text
go to stdout as the token is chosen (:class:`TextStream`); where they came from goes to stderr, so
the text can be piped.
"""

from __future__ import annotations

import codecs
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from mptrain.checkpoint.file import kept_best
from mptrain.config.base import ConfigError, check_settings, require
from mptrain.config.commands import SampleConfig
from mptrain.config.run import RunConfig
from mptrain.data.text import Vocabulary
from mptrain.models.task import logits_of
from mptrain.platform import hardware

# The short forms mptrain sample has always taken, for the keys every command reads.
SHORT_FORMS = {
    "max_new_tokens": "sample.max_new_tokens",
    "temperature": "sample.temperature",
    "top_k": "sample.top_k",
    "checkpoint": "eval.checkpoint",
}
# A prompt is free text: taken verbatim, not through Hydra's override grammar, which strips
# surrounding spaces ("def " would lose its space) and reads , [ ] { } as structure.
PROMPT_KEYS = ("prompt", "sample.prompt")


def sample_settings(argv: list[str]) -> tuple[RunConfig, str]:
    """The checked RunConfig of ``mptrain sample argv`` (composed like every command's) and the
    prompt; ConfigError (one line) for anything else, or without ``resume``."""
    from mptrain.cli.preflight import (
        check_command_line,
        checked_run_config,
        compose_job,
        refuse_hydra_options,
    )

    prompt, overrides = None, []
    for item in argv:
        key, sep, value = item.partition("=")
        if sep and key in PROMPT_KEYS:
            prompt = value
        else:
            overrides.append(f"{SHORT_FORMS[key]}={value}" if sep and key in SHORT_FORMS else item)
    refuse_hydra_options(overrides, "sample")
    if any(o.startswith("hydra.") for o in overrides):
        raise ConfigError("hydra.run.dir: mptrain sample writes to stdout only; leave it out")
    check_command_line(overrides)
    cfg = checked_run_config(compose_job(overrides))
    if not cfg.resume:
        raise ConfigError("resume: required, a checkpoint file or a run directory of task=lm")
    if not any(o.split("=", 1)[0].lstrip("+~") == "eval.checkpoint" for o in overrides):
        cfg.eval.checkpoint = "best" if kept_best(cfg.resume) else "latest"
    return cfg, cfg.sample.prompt if prompt is None else prompt


class LogitsNotFinite(ValueError):
    """The model gave NaN or inf logits: nothing can be drawn from them (damaged weights)."""


def choose_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token ``(batch, 1)`` for the last position's ``logits (batch, vocab)``: the most
    likely one at ``temperature=0``, else a draw from ``softmax(logits / temperature)`` over the
    ``top_k`` most likely tokens (all of them when None). Any temperature > 0, however small or
    large, gives finite probabilities; raises ValueError for a temperature that is not >= 0 and
    :class:`LogitsNotFinite` when the logits are not all finite. Syncs the device (the checks)."""
    if not temperature >= 0:  # NaN included
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if not bool(torch.isfinite(logits).all()):
        raise LogitsNotFinite("the model's logits are not finite (NaN or inf)")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # The largest logit is shifted to 0 before dividing, in float64 (where the temperature keeps
    # its value: 1e-300 is 0 in float32): a tiny temperature then sends the others to -inf
    # (probability 0) and never the largest to +inf, whose softmax would be inf/inf = NaN. As the
    # temperature nears 0 the draw nears the greedy choice (ties share the probability).
    shifted = logits.double() - logits.double().amax(dim=-1, keepdim=True)
    scaled = shifted / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # Chosen on the logits, not the scaled values: at a huge temperature those all round to 0.
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(logits < kth, -torch.inf)
    return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)


@torch.no_grad()
def new_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Each of ``max_new_tokens`` tokens ``(batch, 1)`` the model chooses after ``ids (batch,
    length)``, yielded as soon as it is chosen (see :func:`choose_next`). The model sees at most
    the last ``block_size`` tokens, and only those are kept: memory does not grow with the count."""
    context = ids[:, -block_size:]
    for _ in range(max_new_tokens):
        logits = logits_of(model(context))[:, -1, :].float()
        next_id = choose_next(logits, temperature, top_k, generator)
        yield next_id
        context = torch.cat([context, next_id], dim=1)[:, -block_size:]


def generate(
    model: nn.Module, ids: torch.Tensor, max_new_tokens: int, block_size: int, **sampling: Any
) -> torch.Tensor:
    """``ids (batch, length)`` followed by the ``max_new_tokens`` tokens of :func:`new_tokens`
    (``sampling``: its keywords ``temperature``, ``top_k``, ``generator``)."""
    chosen = new_tokens(model, ids, max_new_tokens, block_size, **sampling)
    return torch.cat([ids, *chosen], dim=1)


def generate_text(
    model: nn.Module,
    prompt: str = SampleConfig.prompt,
    *,
    max_new_tokens: int = SampleConfig.max_new_tokens,
    temperature: float = SampleConfig.temperature,
    top_k: int | None = SampleConfig.top_k,
    seed: int = 0,
) -> str:
    """``prompt`` and its continuation by a language model of :func:`mptrain.load_model`: what
    ``mptrain sample`` prints for the same checkpoint, settings, seed and device, without the
    final newline (``mptrain.generate`` in Python; the defaults are the command's).

    Tokens are chosen as :func:`choose_next` says, on the model's device, with draws from a
    generator seeded with ``seed``; the context is cut to the model's ``mptrain_sequence_length``.
    ConfigError (a ValueError, one line) for a model that is not a language model of
    ``load_model``, a setting out of range, or a prompt :func:`encode_prompt` refuses;
    :class:`LogitsNotFinite` naming the checkpoint for damaged weights. A character that an older
    checkpoint's vocabulary lacks is read as its unknown id, with a warning."""
    if not hasattr(model, "mptrain_vocabulary"):
        raise ConfigError(
            f"{type(model).__name__}: not a model of mptrain.load_model (no mptrain_vocabulary); "
            "load the language model's run with mptrain.load_model(path)"
        )
    vocab, where = model.mptrain_vocabulary, getattr(model, "mptrain_checkpoint", "the model")
    if vocab is None:
        raise ConfigError(
            f"{where}: an image classifier; generate needs a model trained with task=lm"
        )
    check_settings(SampleConfig(prompt, max_new_tokens, temperature, top_k), "sample.")
    require(-(2**63) <= seed < 2**64, "seed", seed, "must fit in 64 bits (-2**63 .. 2**64 - 1)")
    ids, missing = encode_prompt(vocab, prompt)
    if missing:
        warnings.warn(f"{missing} not in the vocabulary: read as unknown", stacklevel=2)
    ids = ids.to(next(model.parameters()).device)
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    sampling = {"temperature": temperature, "top_k": top_k, "generator": generator}
    try:
        out = generate(model, ids, max_new_tokens, model.mptrain_sequence_length, **sampling)
    except LogitsNotFinite as exc:
        raise LogitsNotFinite(f"{where}: {exc}; its weights are damaged") from None
    return vocab.decode(out[0])


class TextStream:
    """Token ids to text piece by piece: the pieces joined (with :meth:`end`) are exactly
    ``vocab.decode`` of all the ids at once. Under a bytes vocabulary a piece may end inside a
    UTF-8 character; its bytes are held until the character is complete (or, at the end, shown
    as U+FFFD, as ``vocab.decode`` does)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self._vocab = vocab
        bytes_vocab = vocab.kind == "bytes"
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if bytes_vocab else None
        # A tokenizer decodes a token by its neighbours (byte-level pieces of one character,
        # word-piece joins): all ids so far are decoded and the text not yet shown is written.
        self._ids: list[int] = []
        self._shown = 0

    def piece(self, ids: list[int]) -> str:
        """The text ``ids`` complete (possibly empty)."""
        if self._vocab.kind == "tokenizer":
            self._ids += ids
            return self._new_text(final=False)
        if self._utf8 is None:
            return self._vocab.decode(ids)
        return self._utf8.decode(bytes(ids))

    def _new_text(self, final: bool) -> str:
        """A tokenizer's text past what was shown; a trailing U+FFFD (a character whose bytes
        are not all chosen yet) is held back until ``final``."""
        text = self._vocab.decode(self._ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        new, self._shown = text[self._shown : end], max(self._shown, end)
        return new

    def end(self) -> str:
        """What is left: U+FFFD for an unfinished UTF-8 character, else nothing."""
        if self._vocab.kind == "tokenizer":
            return self._new_text(final=True)
        return "" if self._utf8 is None else self._utf8.decode(b"", final=True)


def prompt_bytes(vocab: Vocabulary, prompt: str) -> bytes:
    """The prompt as the bytes the user gave. Bytes of a command line that are not UTF-8 reach
    Python as surrogate escapes (PEP 383) and turn back into those bytes: a bytes vocabulary takes
    them as they are; a characters vocabulary, whose tokens are UTF-8 characters, refuses them
    (ConfigError naming ``sample.prompt``), as it refuses anything not encodable."""
    try:
        data = prompt.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as exc:  # a surrogate that stands for no byte
        shown = _shown(prompt.encode("utf-8", errors="backslashreplace"))
        raise ConfigError(
            f"sample.prompt={shown}: character {exc.start} cannot be encoded (a lone "
            "surrogate); give UTF-8 text"
        ) from None
    if vocab.kind != "bytes":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            tokens = "characters (dataset.vocabulary=chars)"
            if vocab.kind == "tokenizer":
                tokens = "from a tokenizer of text (dataset.tokenizer)"
            raise ConfigError(
                f"sample.prompt={_shown(data)}: not UTF-8 (byte 0x{data[exc.start]:02x} at "
                f"offset {exc.start}); this model's tokens are {tokens}: give UTF-8 text"
            ) from None
    return data


def _shown(data: bytes, limit: int = 40) -> str:
    """``data`` for a one-line message: bytes that are not UTF-8 as ``\\xNN``, characters that
    do not print (a newline) escaped, cut after ``limit`` characters."""
    text = data.decode("utf-8", errors="backslashreplace")
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def encode_prompt(vocab: Vocabulary, prompt: str) -> tuple[torch.Tensor, list[str]]:
    """The prompt's token ids ``(1, length)`` and the characters the vocabulary lacks (read as
    its unknown id: only older character vocabularies have one). ConfigError for an empty prompt,
    bytes the vocabulary cannot take (:func:`prompt_bytes`), or characters a vocabulary without
    an unknown id lacks (named: the model has no id for them)."""
    data = prompt_bytes(vocab, prompt)
    missing = [] if vocab.chars is None else sorted(set(prompt) - set(vocab.chars))
    if missing and vocab.unknown_id is None:
        shown = ", ".join(repr(c) for c in missing)
        raise ConfigError(
            f"sample.prompt={_shown(data)}: {shown} not among the {vocab.size} characters the "
            "model was trained on; give a prompt of those characters"
        )
    ids = vocab.encode(data)
    if len(ids) == 0:
        raise ConfigError("prompt: empty; give at least one character (the default is a newline)")
    return ids[None, :], missing


def write_sample(model: nn.Module, ids: torch.Tensor, cfg: RunConfig, out: TextIO) -> None:
    """Write the prompt ``ids (1, length)`` and, as each new token is chosen, its text (flushed:
    a long sample shows as it grows), then a newline; stop early when ``out`` says its reader
    went away (``reader_gone``: mptrain's stdout after a closed pipe). Draws come from a generator seeded with
    ``cfg.seed`` on ``ids``' device. ConfigError naming ``resume`` if the model's logits are not
    finite."""
    s = cfg.sample
    stream = TextStream(model.mptrain_vocabulary)
    out.write(stream.piece(ids[0].tolist()))
    out.flush()
    generator = torch.Generator(device=ids.device).manual_seed(cfg.seed)
    chosen = new_tokens(
        model,
        ids,
        s.max_new_tokens,
        model.mptrain_sequence_length,
        temperature=s.temperature,
        top_k=s.top_k,
        generator=generator,
    )
    try:
        for next_id in chosen:
            out.write(stream.piece(next_id[0].tolist()))
            out.flush()
            if getattr(out, "reader_gone", False):  # `| head -c 5` closed the pipe: stop
                return
    except LogitsNotFinite as exc:
        out.write("\n")
        raise ConfigError(
            f"resume={cfg.resume}: {exc} in {model.mptrain_checkpoint}; its weights are damaged "
            "(a run that diverged?): sample from an earlier checkpoint"
        ) from None
    out.write(stream.end() + "\n")


def _which_words(cfg: RunConfig) -> str:
    """Why this checkpoint of a run directory: `` (best.pt: the best evaluation)``; nothing for a
    checkpoint file, which names itself."""
    if not Path(cfg.resume or "").is_dir():
        return ""
    if cfg.eval.checkpoint == "best":
        return " (best.pt: the best evaluation; eval.checkpoint=latest for the newest)"
    return " (its newest checkpoint)"


def sample_main(argv: list[str]) -> None:
    """``mptrain sample ...``: print the prompt and its continuation (see the module doc)."""
    from mptrain.commands.evaluate import load_model

    cfg, prompt = sample_settings(argv)
    s = cfg.sample
    device = hardware.resolve_device(cfg.device)
    model = load_model(cfg.resume, device, cfg.eval.checkpoint, cfg.trust_checkpoint_code)
    vocab = model.mptrain_vocabulary
    if vocab is None:
        raise ConfigError(
            f"resume={cfg.resume}: an image classifier; mptrain sample needs a model trained "
            "with task=lm"
        )
    ids, missing = encode_prompt(vocab, prompt)
    if missing:
        print(
            f"mptrain sample: note: {missing} not in the vocabulary: read as unknown",
            file=sys.stderr,
        )
    print(
        f"mptrain sample: {model.mptrain_checkpoint}{_which_words(cfg)}, "
        f"temperature {s.temperature:g}, "
        f"top_k {s.top_k}, seed {cfg.seed}, {s.max_new_tokens} new tokens",
        file=sys.stderr,
    )
    write_sample(model, ids.to(device), cfg, sys.stdout)
