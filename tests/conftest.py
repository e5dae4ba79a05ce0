"""The suite's fixtures and hooks (helpers live in the importable ``support`` package: see
tests/README.md). The two tiers:

- plain ``pytest`` is the fast tier: every test not marked ``slow`` (unit tests, in-process CLI
  checks, one short in-process run per precision and task), a few minutes on 2 cores;
- ``pytest -m slow`` is the end-to-end tier: subprocess CLI runs, torchrun, compile, long runs.
  ``.ci/run`` runs the fast tier, then this one. Any ``-m`` expression, or a test named by its
  node id (``path::test``), selects as written: slow tests are left out only by default.

An in-process run draws no curves.png unless its test is marked ``figure`` (see
:func:`figures_only_where_marked`): the figure's child process costs more CPU than a tiny run.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
from support.fragile import FRAGILE
from support.runs import NoFigure

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One of several pytest-xdist workers sharing the cores: torch's default of a thread per core
    # in each would oversubscribe them (torch's threads collapse under contention). Runs the
    # tests start pin threads=1 already; this covers everything else the workers compute.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave ``slow`` tests out of a plain ``pytest`` (see the module docstring)."""
    if config.option.markexpr or any("::" in arg for arg in config.args):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def figures_only_where_marked(request: pytest.FixtureRequest, monkeypatch) -> None:
    """In-process runs draw no figure (:class:`NoFigure`) unless the test is marked ``figure``.

    A run's figure worker (mptrain.output.plots.FigureWorker) is a child process that imports
    matplotlib and draws curves.png: ~1 s of CPU per run, several times a tiny run's training, and
    most tests read nothing of it. The tests marked ``figure`` (the worker, a run's curves.png, a
    signal or an interrupt around it) and every subprocess run keep the real worker.
    """
    if request.node.get_closest_marker("figure") is None:
        from mptrain.train import job

        monkeypatch.setattr(job, "FigureWorker", NoFigure)


@pytest.fixture
def fragile_module(tmp_path, monkeypatch):
    """:mod:`support.fragile`'s models written to ``tmp_path`` as ``fragile_net``, importable."""
    (tmp_path / "fragile_net.py").write_text(textwrap.dedent(FRAGILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("fragile_net", None)
