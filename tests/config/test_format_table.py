"""The format table (mptrain.config.format_table) is the one home of a format's facts: no other
module spells a scaled format's name, and everything that used to keep its own copy reads it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mptrain
from mptrain.config import options
from mptrain.config.format_table import (
    BLOCK_FORMATS,
    FORMAT_TABLE,
    FP8,
    FP8_BLOCKWISE,
    GROUP_OF_PRECISION,
    MXFP8,
    NVFP4,
    PRECISION_OF_GROUP,
)
from mptrain.config.run import RunConfig
from mptrain.perf import gpus, roofline
from mptrain.precision import formats
from mptrain.precision.policy import PRECISIONS
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.blockwise import BLOCKWISE_BLOCK
from mptrain.precision.quant.mx import MX_BLOCK
from mptrain.precision.quant.nvfp4 import NVFP4_BLOCK

PACKAGE = Path(mptrain.__file__).parent
# The names no module may spell but the table and the config's option lists (the options a user
# may type: precision names, advise.plan's recipes, the schema's validation of its own groups).
SCALED_NAMES = {FP8_BLOCKWISE, MXFP8, NVFP4}
MAY_SPELL = {"config/format_table.py", "config/options.py", "config/commands.py"}


def spelled(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``path`` that is exactly a scaled format's name."""
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in SCALED_NAMES
    ]


def test_no_module_but_the_table_spells_a_scaled_formats_name():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in MAY_SPELL and (hits := spelled(path))
    }
    assert found == {}, f"spell these as mptrain.config.format_table constants: {found}"


def test_the_spelling_check_sees_a_literal(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""mxfp8 in a docstring is prose."""\nFMT = "nvfp4"\n')
    assert spelled(sample) == [(2, "nvfp4")]


def test_every_row_is_keyed_by_its_name_and_scaled_rows_are_complete():
    assert all(name == r.name for name, r in FORMAT_TABLE.items())
    assert BLOCK_FORMATS == (FP8_BLOCKWISE, MXFP8, NVFP4)
    for name in (FP8, *BLOCK_FORMATS):
        r = FORMAT_TABLE[name]
        assert r.precision in PRECISIONS and r.precision in options.PRECISION_NAMES, name
        assert hasattr(RunConfig(), r.config_group), name  # the section whose keys set it
        assert r.kernel is not None and r.kernel.needs.startswith("needs "), name
        assert r.elements is not None and r.scale is not None, name
        assert r.peak_row in gpus.RATE_COLUMNS, name


def test_the_readers_take_the_tables_facts():
    """The quantizers' block lengths, the recipe's report, the layer registry, the roofline's
    bytes, the checkpoint signature's groups and advise's exclude keys: all the table's."""
    assert (BLOCKWISE_BLOCK, MX_BLOCK, NVFP4_BLOCK) == (128, 32, 16)
    assert [FORMAT_TABLE[f].block for f in BLOCK_FORMATS] == [128, 32, 16]
    for fmt in BLOCK_FORMATS:
        described = BlockQuantization(fmt).describe()
        assert {op["scale"] for op in described["operands"].values()} == {FORMAT_TABLE[fmt].scale}
        assert fmt in formats.LAYER_FORMATS
        assert roofline.SCALE_BYTES[fmt] == FORMAT_TABLE[fmt].scale_bytes
        assert roofline.FORMAT_BYTES[fmt] == FORMAT_TABLE[fmt].element_bytes
    assert roofline.TENSOR_SCALE_BYTES == {NVFP4: 4}
    assert PRECISION_OF_GROUP == {"fp8": FP8, "mx": MXFP8, "nvfp4": NVFP4}
    assert GROUP_OF_PRECISION == {FP8: "fp8", MXFP8: "mx", NVFP4: "nvfp4"}


@pytest.mark.parametrize(
    ("fmt", "inside", "outside"),
    [
        (FP8, [(8, 9), (9, 0), (12, 0)], [(8, 6), (8, 0)]),
        (FP8_BLOCKWISE, [(9, 0), (9, 9)], [(8, 9), (10, 0), (12, 0)]),
        (MXFP8, [(10, 0), (12, 1)], [(9, 0), (8, 9)]),
        (NVFP4, [(10, 0), (11, 0)], [(9, 0)]),
    ],
)
def test_kernel_ranges(fmt, inside, outside):
    kernel = FORMAT_TABLE[fmt].kernel
    assert all(kernel.runs_on(c) for c in inside)
    assert not any(kernel.runs_on(c) for c in outside)
