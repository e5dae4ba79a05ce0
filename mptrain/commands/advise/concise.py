"""Saying each thing once: ``mptrain advise``'s lists folded where several candidates share one
reason (:func:`grouped`: where no Linear layer converts, as for ``model=cnn``, every low-precision
choice is refused in the same words but for its format and config key, and advise.md and the
console say it on one line, naming the formats and keys together), and long lists of layer names
cut to their first few where a line must stay readable (:func:`capped`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

# The build's refusal when no Linear layer converts (mptrain.precision.formats._require_converted).
REFUSAL = re.compile(
    r"precision=(?P<precision>\S+): no Linear layer of model=(?P<model>\S+) can run in "
    r"(?P<fmt>.+?) \((?P<detail>.*)\); see (?P<key>\w+)\.include/exclude/keep_first_last/min_features"
)
KEYS = "include/exclude/keep_first_last/min_features"
FIRST = 5  # names shown before "… and N more"


def words(items: Sequence[str], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


def capped(names: Sequence[str], first: int = FIRST) -> str:
    """``a, b, c`` or, past ``first`` names, ``a, b, c, d, e … and 7 more``."""
    names = list(names)
    if len(names) <= first + 1:  # "… and 1 more" is no shorter than the name
        return ", ".join(names)
    return f"{', '.join(names[:first])} … and {len(names) - first} more"


def pct(x: float | None) -> str:
    """``0.52%``; ``inf`` when not finite, ``n/a`` when not measured (None)."""
    if x is None:
        return "n/a"
    return f"{x:.2%}" if math.isfinite(x) else "inf"


def db(x: float | None) -> str:
    """``12.3 dB``; ``exact`` for +inf (no error), ``none`` for −inf or NaN (all error), ``n/a``
    when not measured (None)."""
    if x is None:
        return "n/a"
    return f"{x:.1f} dB" if math.isfinite(x) else ("exact" if x > 0 else "none")


def command_lines(command: str) -> list[str]:
    """The command to train with, after a blank line, in a Markdown fence."""
    return ["", "Train with it:", "", "```bash", command, "```"]


def names_words(names: Sequence[str]) -> str:
    """A group of candidates: ``fp8, fp8-rowwise, mxfp8 (3 precisions)``."""
    return f"{', '.join(names)} ({len(names)} precisions)"


def _key(why: str) -> tuple[str, re.Match[str] | None]:
    """What makes two reasons the same: the text, with a refusal's format, key and precision
    left out."""
    m = REFUSAL.search(why)
    if m is None:
        return why, None
    return f"{why[: m.start()]}\0{m['model']}\0{m['detail']}\0{why[m.end() :]}", m


def _merged(why: str, matches: list[re.Match[str]]) -> str:
    """One reason for a group: the refusals' formats and keys named together."""
    first = matches[0]
    precisions = list(dict.fromkeys(m["precision"] for m in matches))
    fmts = list(dict.fromkeys(m["fmt"] for m in matches))
    keys = list(dict.fromkeys(m["key"] for m in matches))
    where = f"{keys[0]}.{KEYS}" if len(keys) == 1 else f"the {KEYS} keys of {words(keys)}"
    said = (
        f"{'precision=' + precisions[0] + ': ' if len(precisions) == 1 else ''}"
        f"no Linear layer of model={first['model']} can run in {words(fmts, 'or')} "
        f"({first['detail']}); see {where}"
    )
    return f"{why[: first.start()]}{said}{why[first.end() :]}"


def grouped(items: Sequence[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """``(name, why)`` pairs folded by their reason, in the order each reason first comes: each
    group's names and its one reason (a lone item's own words; a group of refusals names every
    format and key in one)."""
    return [(names, why) for names, _, why in grouped_parts([(n, "", w) for n, w in items])]


def grouped_parts(items: Sequence[tuple[str, str, str]]) -> list[tuple[list[str], str, str]]:
    """:func:`grouped` for ``(name, part, why)``: folded where both the part (what was not
    measured: ``all``, ``speed`` …) and the reason are the same."""
    groups: dict[tuple[str, str], tuple[list[str], list[str], list[re.Match[str]]]] = {}
    for name, part, why in items:
        key, match = _key(why)
        names, whys, matches = groups.setdefault((part, key), ([], [], []))
        names.append(name)
        whys.append(why)
        if match is not None:
            matches.append(match)
    return [
        (names, part, whys[0] if len(set(whys)) == 1 else _merged(whys[0], matches))
        for (part, _), (names, whys, matches) in groups.items()
    ]
