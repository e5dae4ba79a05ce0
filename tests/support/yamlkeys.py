"""A line scan of YAML files that keeps their comments: the key lines of conf/ and recipes/ (the
comment checks read every key's comment)."""

from __future__ import annotations

import re

# YAML line scan shared by the conf/ and recipes/ comment checks.
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?P<rest>.*)$")


def scalar_key_lines(text: str) -> dict[str, str]:
    """Dotted path -> the rest of the line (value and comment) of every key with a value on its line.

    Keys that open a block (``scaler:``, ``debug:``, ``hydra:``) and list items are left out.
    """
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the open blocks
    for line in text.splitlines():
        match = KEY_LINE.match(line)
        if match is None:
            continue  # blank, comment, list item
        indent, key, rest = len(match["indent"]), match["key"], match["rest"].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), key])
        if rest == "" or rest.startswith("#"):
            stack.append((indent, key))
        else:
            found[path] = rest
    return found


def yaml_leaf_paths(node: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in node.items():
        if not prefix and key == "defaults":
            continue
        if isinstance(value, dict):
            paths |= yaml_leaf_paths(value, f"{prefix}{key}.")
        else:
            paths.add(f"{prefix}{key}")
    return paths
