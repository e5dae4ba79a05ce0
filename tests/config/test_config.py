"""The Hydra config groups in conf/, their typed schemas, validation and one-line error messages.

In-process and CPU-only: configs are composed with Hydra's compose API from the installed
``mptrain.conf`` package (importing :mod:`mptrain.cli` registers the schemas in the ConfigStore).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import itertools
import re

import pytest
import yaml
from hydra import compose, initialize_config_module
from support.yamlkeys import scalar_key_lines, yaml_leaf_paths

from mptrain.cli import app as cli
from mptrain.cli.preflight import check_command_line, describe_compose_error
from mptrain.cli.registry import schema_node_name, to_run_config
from mptrain.config.base import ConfigError
from mptrain.config.models import ViTConfig
from mptrain.config.options import PRECISION_ALIASES, SCHEMAS
from mptrain.config.precision import PrecisionConfig, ScalerConfig
from mptrain.config.run import TASKS, RunConfig, validate
from mptrain.precision.policy import PRECISIONS

CONF = importlib.resources.files("mptrain.conf")


# ----------------------------------------------------------------------------------------- helpers
def config_groups() -> list[str]:
    """Every directory of the installed conf package that holds YAML options."""
    return sorted(
        entry.name
        for entry in CONF.iterdir()
        if entry.is_dir() and any(f.name.endswith(".yaml") for f in entry.iterdir())
    )


def group_files(group: str) -> list[str]:
    """Every option file of ``group``: its options and, for precision, Lightning's names."""
    return sorted(
        f.name.removesuffix(".yaml") for f in (CONF / group).iterdir() if f.name.endswith(".yaml")
    )


def group_options(group: str) -> list[str]:
    """The options of ``group`` (an alias file, such as precision/16-mixed.yaml, is not one)."""
    return [o for o in group_files(group) if o not in PRECISION_ALIASES]


def yaml_files() -> list[str]:
    """Paths of every YAML file in conf/, relative to the package (config.yaml, group/option.yaml)."""
    top = [f.name for f in CONF.iterdir() if f.name.endswith(".yaml")]
    return sorted(top + [f"{g}/{o}.yaml" for g in config_groups() for o in group_files(g)])


def read_yaml_text(relative: str) -> str:
    return CONF.joinpath(*relative.split("/")).read_text(encoding="utf-8")


def load_option(group: str, option: str) -> dict:
    return yaml.safe_load(read_yaml_text(f"{group}/{option}.yaml"))


def compose_run(*overrides: str) -> RunConfig:
    """Compose conf/config.yaml with overrides and convert it to the typed, validated RunConfig."""
    with initialize_config_module(
        config_module=cli.CONFIG_MODULE, version_base=cli.HYDRA_VERSION_BASE
    ):
        cfg = compose(config_name=cli.CONFIG_NAME, overrides=list(overrides))
    return to_run_config(cfg)


def raw_compose_error(*overrides: str) -> Exception:
    """The exception Hydra's compose itself raises for these overrides (fails if it raises none)."""
    with initialize_config_module(
        config_module=cli.CONFIG_MODULE, version_base=cli.HYDRA_VERSION_BASE
    ):
        try:
            compose(config_name=cli.CONFIG_NAME, overrides=list(overrides))
        except Exception as exc:  # Hydra and OmegaConf raise several exception types
            return exc
    pytest.fail(f"compose accepted {overrides}")


def preflight_error(*overrides: str, multirun: bool = False) -> str:
    """The ConfigError message preflight raises for these overrides (fails if it raises none)."""
    with pytest.raises(ConfigError) as info:
        check_command_line([*(["-m"] if multirun else []), *overrides])
    return str(info.value)


def assert_one_line(message: str) -> None:
    assert message, "empty error message"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"
    assert message == message.strip()


def field_names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def listed_after(message: str, marker: str) -> list[str]:
    """The comma-separated names that follow ``marker`` to the end of the message."""
    assert marker in message, f"{marker!r} not in {message!r}"
    return message.split(marker, 1)[1].split(", ")


def set_path(run: RunConfig, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    node = run
    for name in parents:
        node = getattr(node, name)
    setattr(node, leaf, value)


# Options that cannot compose without a value the user must give (``???`` in their YAML).
REQUIRED_OVERRIDES = {
    ("dataset", "imagefolder"): ["dataset.root=/data/imagenet"],
    ("model", "custom"): ["model._target_=my_pkg.MyNet"],
    ("dataset", "custom"): ["dataset._target_=my_pkg.make_data"],
    ("model", "gpt"): ["task=lm"],  # a language model: trains with task=lm only
    ("model", "hf"): ["task=lm"],
    ("dataset", "text"): ["task=lm"],
}
# Groups whose options overlay the others (``# @package _global_``), with no schema of their own.
OVERLAY_GROUPS = ("task",)
SCHEMA_GROUPS = [group for group in config_groups() if group not in OVERLAY_GROUPS]

GROUP_OPTIONS = [(group, option) for group in SCHEMA_GROUPS for option in group_options(group)]


# ------------------------------------------------------------------------------- groups and options
def test_config_groups_are_the_registered_ones():
    assert sorted(SCHEMAS) == SCHEMA_GROUPS


def test_task_options_are_the_tasks():
    assert sorted(group_options("task")) == sorted(TASKS)
    for task in TASKS:
        assert compose_run(f"task={task}").task == task


@pytest.mark.parametrize("group", sorted(SCHEMAS))
def test_group_option_files_are_the_options_of_the_table(group):
    assert set(group_options(group)) == set(SCHEMAS[group])


def builder_tables() -> dict[str, dict[str, object]]:
    from mptrain.data.build import DATASETS
    from mptrain.models.build import MODELS
    from mptrain.train.optim import OPTIMIZERS, SCHEDULES

    return {"model": MODELS, "dataset": DATASETS, "optimizer": OPTIMIZERS, "scheduler": SCHEDULES}


@pytest.mark.parametrize("group", ["model", "dataset", "optimizer", "scheduler"])
def test_every_option_name_has_one_schema_and_one_builder(group):
    """config.options (what composing needs, no torch) and the builder tables name the same
    options with the same schemas."""
    built = {name: option.schema for name, option in builder_tables()[group].items()}
    assert built == SCHEMAS[group]


def test_the_precision_names_are_the_precision_table():
    from mptrain.config.options import AUTO, PRECISION_NAMES

    assert set(SCHEMAS["precision"]) == {AUTO, *PRECISION_NAMES} == {AUTO, *PRECISIONS}


@pytest.mark.parametrize(
    ("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS]
)
def test_every_group_option_composes_to_its_typed_schema(group, option):
    schema_names = load_option(group, option)["defaults"]
    assert len(schema_names) == 1, f"{group}/{option}.yaml must name exactly one schema"
    # Defaults entries read /<option>_<group>_schema@_here_: the option's own schema node.
    assert schema_names[0].split("@")[0] == "/" + schema_node_name(group, option)
    expected_type = SCHEMAS[group][option]

    run = compose_run(f"{group}={option}", *REQUIRED_OVERRIDES.get((group, option), []))

    assert isinstance(run, RunConfig)
    node = getattr(run, group)
    assert type(node) is expected_type
    assert node.name == option


def test_imagefolder_without_root_names_the_missing_key():
    message = preflight_error("dataset=imagefolder")
    assert_one_line(message)
    assert message.startswith("dataset.root:")


# ------------------------------------------------------------------------------- YAML key comments
# Keys that may go without a comment: an option's ``name`` (it repeats the file name, checked by
# test_every_group_option_composes_to_its_typed_schema) and Hydra's own output-directory patterns.
UNCOMMENTED_KEYS: set[str] = set()  # every key carries a comment


@pytest.mark.parametrize("relative", yaml_files())
def test_line_scan_finds_every_yaml_key(relative):
    """Guards the comment test below: the line scan sees exactly the keys YAML parses."""
    text = read_yaml_text(relative)
    assert set(scalar_key_lines(text)) == yaml_leaf_paths(yaml.safe_load(text))


@pytest.mark.parametrize("relative", yaml_files())
def test_every_yaml_key_with_a_value_carries_a_comment(relative):
    lines = scalar_key_lines(read_yaml_text(relative))
    uncommented = sorted(
        path
        for path, rest in lines.items()
        if not re.search(r"\s#\s*\S", rest) and path not in UNCOMMENTED_KEYS
    )
    assert uncommented == [], f"{relative}: keys without a comment: {uncommented}"


# ------------------------------------------------------------------------------ precision options
SCALER_SETTINGS = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5}


def test_every_precision_option_is_in_the_table():
    assert set(group_options("precision")) == {"auto", *PRECISIONS}


@pytest.mark.parametrize("name", sorted(["auto", *PRECISIONS]))
def test_precision_yaml_holds_no_value(name):
    """What a precision runs is the table's; its tunables' defaults are the schema's."""
    assert set(load_option("precision", name)) == {"defaults"}


@pytest.mark.parametrize("name", sorted(["auto", *PRECISIONS]))
def test_composed_precision_is_named_and_has_the_default_scaler(name):
    precision = compose_run(f"precision={name}").precision
    assert precision == PrecisionConfig(
        name=name,
        scaler=ScalerConfig(**SCALER_SETTINGS, growth_interval=2000),
        allow_tf32=False,
    )
    assert type(precision.scaler.growth_interval) is int


# ------------------------------------------------------------------------------------ validation
OUT_OF_RANGE = [
    # id, overrides, the same change made on a typed RunConfig, message pattern
    ("lr-zero", ["optimizer.lr=0"], {"optimizer.lr": 0.0}, r"^optimizer\.lr=0\.0: "),
    (
        "lr-negative",
        ["optimizer=sgd", "optimizer.lr=-0.1"],
        {"optimizer.lr": -0.1},
        r"^optimizer\.lr=-0\.1: ",
    ),
    ("batch-size-zero", ["batch_size=0"], {"batch_size": 0}, r"^batch_size=0: .*>= 1"),
    (
        "eval-minutes-zero",
        ["eval_every_minutes=0"],
        {"eval_every_minutes": 0.0},
        r"^eval_every_minutes=0\.0: must be > 0",
    ),
    (
        "checkpoint-minutes-inf",
        ["checkpoint.every_minutes=inf"],
        {"checkpoint.every_minutes": float("inf")},
        r"^checkpoint\.every_minutes=inf: must be > 0 and finite",
    ),
    (
        "grad-accum-zero",
        ["grad_accum_steps=0"],
        {"grad_accum_steps": 0},
        r"^grad_accum_steps=0: .*>= 1",
    ),
    (
        "growth-factor-one",
        ["precision.scaler.growth_factor=1"],
        {"precision.scaler.growth_factor": 1.0},
        r"^precision\.scaler\.growth_factor=1\.0: must be > 1",
    ),
    (
        "growth-factor-below-one",
        ["precision.scaler.growth_factor=0.5"],
        {"precision.scaler.growth_factor": 0.5},
        r"^precision\.scaler\.growth_factor=0\.5: ",
    ),
    *(
        (
            f"backoff-factor-{value}",
            [f"precision.scaler.backoff_factor={value}"],
            {"precision.scaler.backoff_factor": float(value)},
            rf"^precision\.scaler\.backoff_factor={float(value)}: .*\(0, 1\)",
        )
        for value in ("0", "1", "1.5")
    ),
    (
        "growth-interval-zero",
        ["precision.scaler.growth_interval=0"],
        {"precision.scaler.growth_interval": 0},
        r"^precision\.scaler\.growth_interval=0: ",
    ),
    (
        "init-scale-zero",
        ["precision.scaler.init_scale=0"],
        {"precision.scaler.init_scale": 0.0},
        r"^precision\.scaler\.init_scale=0\.0: must be > 0",
    ),
    (
        "max-steps-beyond-a-c-int",  # trained a step, then OverflowError (exit 1)
        ["max_steps=9223372036854775807"],
        {"max_steps": 9223372036854775807},
        r"^max_steps=9223372036854775807: at most 2,147,483,647$",
    ),
    ("clip-zero", ["clip_grad_norm=0"], {"clip_grad_norm": 0.0}, r"^clip_grad_norm=0\.0: "),
    (
        "label-smoothing-one",
        ["label_smoothing=1.0"],
        {"label_smoothing": 1.0},
        r"^label_smoothing=1\.0: .*\[0, 1\)",
    ),
    ("device-tpu", ["device=tpu"], {"device": "tpu"}, r"^device='tpu': .*cuda:N"),
    (
        "vit-heads-not-dividing-dim",
        ["model=vit", "model.heads=3"],
        {"model": ViTConfig(heads=3)},
        r"^model\.dim=64: .*model\.heads=3",
    ),
]
OUT_OF_RANGE_IDS = [case[0] for case in OUT_OF_RANGE]


@pytest.fixture(scope="module")
def composed_default() -> RunConfig:
    return compose_run()


@pytest.fixture
def default_run(composed_default) -> RunConfig:
    return copy.deepcopy(composed_default)


def test_default_config_is_valid(default_run):
    validate(default_run)  # raises on a violation
    assert check_command_line([]).jobs == [[]]


@pytest.mark.parametrize(
    ("case", "overrides", "changes", "pattern"), OUT_OF_RANGE, ids=OUT_OF_RANGE_IDS
)
def test_preflight_rejects_out_of_range_value(case, overrides, changes, pattern):
    message = preflight_error(*overrides)
    assert_one_line(message)
    assert re.search(pattern, message), message


@pytest.mark.parametrize(
    ("case", "overrides", "changes", "pattern"), OUT_OF_RANGE, ids=OUT_OF_RANGE_IDS
)
def test_validate_rejects_out_of_range_value_in_typed_config(
    default_run, case, overrides, changes, pattern
):
    for dotted, value in changes.items():
        set_path(default_run, dotted, value)
    with pytest.raises(ConfigError, match=pattern):
        validate(default_run)


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.lr=1e-9"],
        ["precision.scaler.growth_factor=1.0001"],
        ["precision.scaler.backoff_factor=0.999", "precision.scaler.growth_interval=1"],
        ["label_smoothing=0.999", "clip_grad_norm=0.001"],
        ["epochs=null", "max_steps=1"],
        ["model=vit", "model.heads=8"],
        ["device=cpu"],
        ["device=cuda:1"],
    ],
    ids=str,
)
def test_values_just_inside_the_range_are_accepted(overrides):
    assert len(check_command_line(overrides).jobs) == 1


@pytest.mark.parametrize("dim", [0, -4])
def test_vit_dim_must_be_positive(dim):
    message = preflight_error("model=vit", f"model.dim={dim}")
    assert message.startswith("model.dim=")


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:"])
def test_cuda_device_index_must_be_a_number(default_run, device):
    default_run.device = device
    with pytest.raises(ConfigError, match=r"^device="):
        validate(default_run)


@pytest.mark.parametrize(
    "overrides",
    [
        ("optimizer.lr=inf",),
        ("precision.scaler.init_scale=inf",),
    ],
    ids=["lr-inf", "init-scale-inf"],
)
def test_infinite_values_are_refused(overrides):
    key = overrides[0].split("=")[0]
    assert preflight_error(*overrides).startswith(f"{key}=")


def test_schemas_are_not_selectable_as_options():
    message = preflight_error("model=mlp_model_schema")
    assert message.startswith("model=mlp_model_schema: unknown option")


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("precision.autocast_dtype=bfloat16", r"^precision\.autocast_dtype: unknown key"),
        ("model.name=vit", r"^model\.name='vit': names another option .*model=vit$"),
        ("precision.name=fp12", r"^precision\.name='fp12': one of auto, fp32, fp16, bf16"),
        ("scheduler.name=linear", r"^scheduler\.name='linear': one of constant, cosine"),
    ],
    ids=["fixed-dtype-key", "model-name-of-another-option", "precision-name", "scheduler-name"],
)
def test_what_an_option_fixes_cannot_be_overridden(override, pattern):
    message = preflight_error(override)
    assert_one_line(message)
    assert re.search(pattern, message), message


# ------------------------------------------------------------------------- compose error messages
def test_unknown_precision_option_lists_the_real_choices():
    message = preflight_error("precision=fp12")
    assert_one_line(message)
    assert message.startswith("precision=fp12: ")
    assert listed_after(message, "choose one of ") == [
        "auto",
        "bf16",
        "bf16_pure",
        "fp16",
        "fp16_noscale",
        "fp16_pure",
        "fp32",
        "fp8",
        "mxfp8",
        "nvfp4",
    ]
    assert "_schema" not in message


@pytest.mark.parametrize("group", config_groups())
def test_unknown_option_of_any_group_lists_its_yaml_options(group):
    message = preflight_error(f"{group}=no_such_option")
    assert_one_line(message)
    assert message.startswith(f"{group}=no_such_option: ")
    assert listed_after(message, "choose one of ") == group_options(group)


@pytest.mark.parametrize(
    ("override", "key", "schema"),
    [
        ("foo=1", "foo", RunConfig),
        ("precision.foo=1", "precision.foo", PrecisionConfig),
        ("+foo=1", "foo", RunConfig),
        ("+precision.scaler.bar=2", "precision.scaler.bar", ScalerConfig),
    ],
)
def test_unknown_key_names_it_and_the_accepted_keys(override, key, schema):
    message = preflight_error(override)
    assert_one_line(message)
    assert message.startswith(f"{key}: unknown key")
    assert listed_after(message, "accepted keys: ") == field_names(schema)


def test_wrong_type_names_the_key_and_the_value():
    message = preflight_error("batch_size=abc")
    assert_one_line(message)
    assert message.startswith("batch_size: ")
    assert "'abc'" in message


def test_unparseable_override_is_one_line():
    message = preflight_error("batch_size=[1")
    assert_one_line(message)
    assert message.startswith("cannot parse override: ")


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        ("mlflow.run_name=café", """'mlflow.run_name="café"'"""),
        ("dataset.path=/tmp/dätä.txt", """'dataset.path="/tmp/dätä.txt"'"""),
    ],
)
def test_a_non_ascii_value_unquoted_is_refused_with_how_to_quote_it(override, quoted):
    """Hydra reads unquoted values as ASCII only; its lexer error alone does not say so."""
    message = preflight_error(override)
    assert_one_line(message)
    assert message.startswith(f"cannot parse override: LexerNoViableAltException: {override}")
    assert message.endswith(f"must be quoted for Hydra, and the quotes for the shell: {quoted}")
    check_command_line(["task=lm", quoted.strip("'")])  # what the hint says is accepted


@pytest.mark.parametrize(
    ("override", "prefix"),
    [
        ("precision=fp12", "precision=fp12: unknown option"),
        ("foo=1", "foo: unknown key"),
        ("precision.foo=1", "precision.foo: unknown key"),
        ("batch_size=abc", "batch_size: "),
    ],
)
def test_describe_compose_error_turns_hydra_exceptions_into_one_line(override, prefix):
    message = describe_compose_error(raw_compose_error(override))
    assert_one_line(message)
    assert message.startswith(prefix)


# ------------------------------------------------------------------------------------------ sweeps
def test_sweep_expands_to_every_combination():
    overrides = ["precision=fp32,fp16,bf16", "model=mlp,cnn"]
    checked = check_command_line(["-m", *overrides])
    assert len(checked.jobs) == 6
    jobs = {tuple(job) for job in checked.jobs}
    expected = itertools.product(
        [f"precision={p}" for p in ("fp32", "fp16", "bf16")], ["model=mlp", "model=cnn"]
    )
    assert jobs == set(expected)


@pytest.mark.parametrize(
    ("overrides", "prefix"),
    [
        (["precision=fp32,fp12"], "precision=fp12: unknown option"),
        (["model=mlp", "batch_size=8,0"], "batch_size=0: "),
    ],
)
def test_sweep_with_one_bad_value_fails_naming_it(overrides, prefix):
    message = preflight_error(*overrides, multirun=True)
    assert_one_line(message)
    assert message.startswith(prefix)


def test_sweep_syntax_without_multirun_is_refused():
    message = preflight_error("model=mlp,cnn")
    assert_one_line(message)
    assert "model=mlp,cnn" in message


# ------------------------------------------------------------- settings that do not train
def test_non_training_keys_come_from_the_schema_and_a_new_setting_is_compared():
    """Issue 27, item 12: a hand-kept list missed advise.*, putting it in every resume signature
    and sweep pairing key. The list is derived from field metadata; unmarked means compared."""
    from dataclasses import dataclass, field

    from mptrain.config.base import NOT_TRAINING
    from mptrain.config.keys import non_training_keys

    @dataclass
    class Tool:
        budget: float = 1.0

    @dataclass
    class Option:
        width: int = 8
        cache: str = field(default="x", metadata=NOT_TRAINING)

    @dataclass
    class Schema:
        lr: float = 0.1
        new_setting: int = 0
        tool: Tool = field(default_factory=Tool, metadata=NOT_TRAINING)
        group: object = None

    assert non_training_keys(Schema, {"group": {"a": Option}}) == ("tool", "group.cache")


def test_every_command_setting_is_left_out_of_resume_and_comparisons():
    from types import SimpleNamespace

    from mptrain.checkpoint.checkpointer import run_signature
    from mptrain.config.keys import flatten as flat
    from mptrain.config.keys import is_non_training_key
    from mptrain.precision.plugin import Precision

    cfg = compose_run("model=mlp", "device=cpu")
    for key in flat(dataclasses.asdict(cfg)):
        if key.split(".")[0] in ("bench", "advise", "eval", "sample", "logger", "mlflow"):
            assert is_non_training_key(key), key
    signature = run_signature(cfg, Precision(SimpleNamespace(name="fp32", fp8=None)))
    assert not [k for k in signature if k.startswith(("advise.", "bench.", "sample.", "eval."))]
