"""``mptrain --help`` and ``mptrain COMMAND --help``: short usage texts, read from the shipped
files without composing a config. The groups and options are the files of ``conf/`` (and of
``-cd DIR``) and the recipes; a subcommand's keys, their defaults and help are its section of the
schema (:mod:`mptrain.config.help`). The full composed config: ``mptrain --cfg job``.
"""

from __future__ import annotations

import re
import textwrap
from importlib.resources import files
from pathlib import Path

from mptrain.cli.arguments import COMMANDS
from mptrain.cli.preflight import CONFIG_MODULE
from mptrain.config.help import section_help, section_keys
from mptrain.config.options import PRECISION_ALIASES, SCHEMAS
from mptrain.config.recipes import recipe_files

# Each command's page in docs/ and an example of it.
COMMAND_DOCS = {
    "advise": ("docs/advise.md", "mptrain advise model=mlp advise.budget_s=60"),
    "bench": ("docs/advise.md", "mptrain bench model=mlp bench.steps=20"),
    "eval": ("docs/python-api.md", "mptrain eval resume=outputs/RUN_DIR eval.checkpoint=best"),
    "sample": ("docs/language-models.md", "mptrain sample resume=outputs/RUN_DIR prompt='def '"),
}
_DEFAULT_LINE = re.compile(r"^\s+-\s+(\w+):\s*(\S+)")
_USAGE = re.compile(r"^`(?P<usage>[^`]+)`:\s*(?P<what>.*)$")


def usage_text(config_dir: str | None = None) -> str:
    """What ``mptrain --help`` prints: how to run, the commands, the groups and their options
    (with ``-cd DIR``, that directory's too), and where the rest is."""
    config = files(CONFIG_MODULE).joinpath("config.yaml").read_text(encoding="utf-8")
    commands = [f"  {name:<9} {_command_summary(name)[1]}" for name in COMMANDS]
    return "\n".join(
        [
            "usage: mptrain [group=option | key=value ...]       train one run",
            "       mptrain -m key=a,b [group=x,y ...]            a sweep: one run per combination",
            "       mptrain COMMAND [key=value ...]               another command (below)",
            "       mptrain --cfg job [overrides]                 print the composed config, run nothing",
            "",
            "mptrain: a mixed-precision training runner (fp32, fp16 + dynamic loss scaling, bf16, fp8)",
            "on Hydra. Example: mptrain precision=bf16 model=mlp epochs=5",
            "",
            "commands (mptrain COMMAND --help for each):",
            *commands,
            f"  {'(compare)':<9} mptrain-compare RUN_OR_SWEEP_DIR ...: compare finished runs "
            "(its own command)",
            "",
            "config groups (group=option; * the default):",
            *_group_lines(config, config_dir),
            "",
            "every key: docs/configuration.md (its default and what it does); mptrain --cfg job",
            "flags: -m/--multirun, -cd/--config-dir DIR, -cn/--config-name NAME, --cfg job|hydra|all,",
            "       --resolve, -p/--package KEY, --info [defaults|searchpath|...], --hydra-help, --version",
            "docs: docs/README.md (configuration.md: keys, errors, your own config directory)",
        ]
    )


def command_help(command: str) -> str:
    """What ``mptrain COMMAND --help`` prints: its usage, what it does, its keys with their
    defaults and help (its section of the schema), an example and its docs page."""
    usage, what = _command_summary(command)
    page, example = COMMAND_DOCS[command]
    settings = [(f"{command}.{k.path}={k.default}", k.help) for k in section_keys(command)]
    width = max(len(setting) for setting, _ in settings)
    keys = [f"  {setting:<{width}}  {comment}" for setting, comment in settings]
    # sample prints its text; the others write a directory of results.
    writes = f"  hydra.run.dir=DIR: where it writes (default outputs/{command}/<date>/<time>_...)"
    return "\n".join(
        [
            f"usage: {usage}",
            "",
            f"{what[:1].upper()}{what[1:]}.",
            "",
            "keys (key=value; the default shown):",
            *keys,
            "  any training key or group (model=, dataset=, batch_size=, ...): what it works on",
            *([writes] if command != "sample" else []),
            "",
            f"example: {example}",
            f"docs: {page}",
        ]
    )


def _command_summary(command: str) -> tuple[str, str]:
    """(usage, what it does) from the help of the command's section of the schema
    (``advise``: "`mptrain advise [overrides]`: measure every precision here ...")."""
    match = _USAGE.match(section_help(command))
    return match["usage"], match["what"]


def _group_lines(config: str, config_dir: str | None) -> list[str]:
    defaults = dict(
        m.groups() for m in map(_DEFAULT_LINE.match, config.splitlines()) if m is not None
    )
    options = _options(config_dir)
    lines = []
    for group in _ordered_groups(options):
        names = [f"{o}*" if o == defaults.get(group) else o for o in options[group]]
        lines += _wrapped(f"{group:<10} ", ", ".join(names))
        if group == "precision":
            lines += _wrapped(" " * 11, f"(Lightning's names too: {', '.join(PRECISION_ALIASES)})")
    return lines


def _wrapped(head: str, text: str) -> list[str]:
    """``head`` + ``text`` in lines of at most 100 characters, indented under the text."""
    indent = "  " + " " * len(head)
    return textwrap.wrap(
        text, 100, initial_indent=f"  {head}", subsequent_indent=indent, break_on_hyphens=False
    )


def _options(config_dir: str | None) -> dict[str, list[str]]:
    """Each group's options: the YAML files of conf/ and of ``config_dir``, the recipes; a
    group's table order (mptrain.config.options.SCHEMAS) first, then any other name sorted."""
    found: dict[str, set[str]] = {"recipe": set(recipe_files())}
    roots = [files(CONFIG_MODULE)]
    if config_dir is not None and Path(config_dir).is_dir():
        roots.append(Path(config_dir))
    for root in roots:
        for group in root.iterdir():
            if group.is_dir() and not group.name.startswith(("_", ".")):
                names = {
                    f.name.removesuffix(".yaml")
                    for f in group.iterdir()
                    if f.name.endswith(".yaml")
                }
                found.setdefault(group.name, set()).update(names - set(PRECISION_ALIASES))
    ordered = {}
    for group, names in found.items():
        table = [o for o in SCHEMAS.get(group, {}) if o in names]
        ordered[group] = [*table, *sorted(names - set(table))]
    return ordered


def _ordered_groups(options: dict[str, list[str]]) -> list[str]:
    first = [g for g in (*SCHEMAS, "task", "recipe") if g in options]
    return [*first, *sorted(set(options) - set(first))]
