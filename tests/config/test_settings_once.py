"""Each setting's default and help live once, on its schema field (issue 41): conf/config.yaml
holds no value, the composed config's defaults are the schema's, and what `mptrain COMMAND --help`
and docs/configuration.md say is generated from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import support.runs  # noqa: F401  (registers mptrain's configs with Hydra)
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mptrain.cli.usage import command_help
from mptrain.config import help as settings
from mptrain.config.base import setting
from mptrain.config.options import SCHEMAS
from mptrain.config.run import RunConfig

REPO = Path(__file__).resolve().parents[2]


def test_config_yaml_holds_no_value_of_the_schema():
    """Only which option of each group a run starts from, and Hydra's own keys."""
    config = yaml.safe_load((REPO / "conf" / "config.yaml").read_text(encoding="utf-8"))
    assert set(config) == {"defaults", "hydra"}
    schema = {f.name for f in dataclasses.fields(RunConfig)}
    assert not schema & set(config["hydra"])  # no run key hidden under hydra either


def test_the_composed_defaults_are_the_schemas():
    """Hydra's composition of the shipped config (before the schema's own resolution, e.g.
    epochs=null -> 15) holds every key at its field's default."""
    with initialize_config_module(config_module="mptrain.conf", version_base="1.3"):
        composed = OmegaConf.to_container(compose(config_name="config"))
    for key in (k for k in settings.all_keys() if not k.section):
        value = composed
        for part in key.path.split("."):
            value = value[part]
        assert settings.yaml_value(value) == key.default, key.path


def test_every_setting_has_one_line_of_help():
    schemas = [RunConfig, *(s for options in SCHEMAS.values() for s in options.values())]
    every = [(s.__name__, k) for s in dict.fromkeys(schemas) for k in settings.all_keys(s)]
    missing = [
        f"{schema}.{k.path}"
        for schema, k in every
        if k.path != "name" and (not k.help.strip() or "\n" in k.help)
    ]
    assert missing == []


def _leaves(node: dict, prefix: str = "") -> dict[str, object]:
    found = {}
    for key, value in node.items():
        if isinstance(value, dict):
            found.update(_leaves(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = value
    return found


@pytest.mark.parametrize(
    ("group", "option"), [(g, o) for g, options in SCHEMAS.items() for o in options]
)
def test_an_options_yaml_holds_only_where_it_differs_from_its_schema(group, option):
    path = REPO / "conf" / group / f"{option}.yaml"
    if not path.exists():  # an option a Lightning name or a recipe reaches: nothing of its own
        pytest.skip(f"conf/{group}/{option}.yaml does not exist")
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    values.pop("defaults", None)
    keys = settings.all_keys(SCHEMAS[group][option])
    defaults = {k.path: k.default for k in keys if not k.section}
    same = [k for k, v in _leaves(values).items() if settings.yaml_value(v) == defaults.get(k)]
    assert same == [], f"conf/{group}/{option}.yaml repeats its schema's defaults: {same}"


def test_the_docs_key_table_is_the_schemas():
    """To update the page: python -m mptrain.config.help docs/configuration.md"""
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert settings.with_key_table(page) == page
    for key in settings.all_keys():
        assert (
            f"| `{key.path}.*` | |" if key.section else f"| `{key.path}` | `{key.default}` |"
        ) in page


@pytest.mark.parametrize("command", ["advise", "bench", "eval", "sample"])
def test_command_help_lists_its_sections_keys_from_the_schema(command):
    text = command_help(command)
    for key in settings.section_keys(command):
        assert f"{command}.{key.path}={key.default}" in text
        assert key.help in text


@dataclasses.dataclass
class Section:
    depth: int = setting(3, "how deep")
    names: list[str] = setting(help="which ones", factory=list)


@dataclasses.dataclass
class Schema:
    section: Section = setting(help="a section", factory=Section)


def test_a_new_setting_is_one_field():
    """A field made by setting() carries its default and help; all_keys() finds it, no YAML."""
    assert settings.all_keys(Schema) == [
        settings.Key("section", "", "a section", section=True),
        settings.Key("section.depth", "3", "how deep"),
        settings.Key("section.names", "[]", "which ones"),
    ]
