"""``mptrain sample``: text from a trained language model, so a user sees what it learned.

    mptrain sample resume=RUN_DIR prompt="def " max_new_tokens=200 temperature=0.8 top_k=40

``resume`` is a checkpoint file or a run directory (``checkpoint=latest``: its newest checkpoint
that loads; ``best``: best.pt). The model is rebuilt as :func:`mptrain.commands.evaluate.load_model`
does (the plain FP32 architecture with the trained weights) and generates autoregressively:
each new token is drawn from the softmax of the last position's logits divided by
``temperature``, restricted to the ``top_k`` most likely tokens (``temperature=0``: always the most
likely token). The context is cut to the model's ``block_size``. The prompt and the continuation
go to stdout; where they came from goes to stderr, so the text can be piped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.data.text import Vocabulary
from mptrain.platform import hardware


@dataclass
class SampleArgs:
    """What ``mptrain sample`` accepts (``key=value`` each)."""

    resume: str | None = None  # a checkpoint file or run directory (required)
    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40  # None (top_k=null): sample from the whole vocabulary
    seed: int = 0
    device: str = "auto"
    checkpoint: str = "latest"  # in a run directory: latest | best


def parse_args(argv: list[str]) -> SampleArgs:
    """``key=value`` arguments -> :class:`SampleArgs`; ConfigError (one line) for anything else."""
    args, kinds = SampleArgs(), {f.name: f.type for f in fields(SampleArgs)}
    accepted = ", ".join(kinds)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in kinds:
            raise ConfigError(
                f"{item}: unknown argument; mptrain sample takes key=value of {accepted}"
            )
        setattr(args, key, _convert(key, value, kinds[key]))
    _check(args)
    return args


def _convert(key: str, value: str, kind: str) -> Any:
    if value in ("null", "None") and "None" in kind:
        return None
    if kind.startswith("str"):
        return value
    number = float if kind.startswith("float") else int
    try:
        return number(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: must be a number ({number.__name__})") from None


def _check(args: SampleArgs) -> None:
    if not args.resume:
        raise ConfigError("resume: required, a checkpoint file or a run directory of task=lm")
    if args.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={args.max_new_tokens}: must be an integer >= 1")
    if args.temperature < 0:
        raise ConfigError(
            f"temperature={args.temperature}: must be >= 0 (0: the most likely token)"
        )
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"top_k={args.top_k}: must be an integer >= 1, or null for all tokens")
    if args.checkpoint not in ("latest", "best"):
        raise ConfigError(f"checkpoint={args.checkpoint!r}: latest or best")


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``ids (batch, length)`` followed by ``max_new_tokens`` tokens the model chose, one at a time
    (see the module doc); the model sees at most the last ``block_size`` tokens."""
    for _ in range(max_new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :].float()
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -torch.inf)
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def encode_prompt(vocab: Vocabulary, prompt: str) -> tuple[torch.Tensor, list[str]]:
    """The prompt's token ids ``(1, length)`` and the characters the vocabulary lacks."""
    data = prompt.encode("utf-8")
    missing = [] if vocab.chars is None else sorted(set(prompt) - set(vocab.chars))
    ids = vocab.encode(data)
    if len(ids) == 0:
        raise ConfigError("prompt: empty; give at least one character (the default is a newline)")
    return ids[None, :], missing


def sample_main(argv: list[str]) -> None:
    """``mptrain sample ...``: print the prompt and its continuation (see the module doc)."""
    from mptrain.commands.evaluate import load_model

    args = parse_args(argv)
    device = hardware.resolve_device(args.device)
    model = load_model(args.resume, device, args.checkpoint)
    vocab = model.mptrain_vocabulary
    if vocab is None:
        raise ConfigError(
            f"resume={args.resume}: an image classifier; mptrain sample needs a model trained "
            "with task=lm"
        )
    ids, missing = encode_prompt(vocab, args.prompt)
    if missing:
        print(
            f"mptrain sample: note: {missing} not in the vocabulary: read as unknown",
            file=sys.stderr,
        )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(
        model,
        ids.to(device),
        args.max_new_tokens,
        model.mptrain_sequence_length,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
    )
    print(
        f"mptrain sample: {model.mptrain_checkpoint}, temperature {args.temperature:g}, "
        f"top_k {args.top_k}, seed {args.seed}, {args.max_new_tokens} new tokens",
        file=sys.stderr,
    )
    sys.stdout.write(vocab.decode(out[0].cpu()) + "\n")
