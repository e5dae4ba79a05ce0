"""Values far outside any sane range are bad input, named in one line with exit 2 (issue 39,
items 17 and 18): a thread count of 20,000 aborted in libgomp and 100,000 segfaulted (no report,
the run directory's lock left behind); a 100,000-digit seed failed in Python's integer parser
without naming ``seed``; epochs whose steps pass a C int failed mid-run."""

from __future__ import annotations

import pytest
from support.runs import run_cli, tiny_run

from mptrain.cli.preflight import refuse_huge_numbers
from mptrain.config.base import ConfigError
from mptrain.platform.contention import affinity_cpus
from mptrain.train import threads
from mptrain.train.build import prepare_run


@pytest.mark.parametrize("count", [20000, 100000])
def test_a_thread_count_far_beyond_the_cpus_is_refused(count, tmp_path, monkeypatch):
    most = threads.MAX_THREADS_PER_CPU * affinity_cpus()
    outcome = run_cli(
        ["model=mlp", "max_steps=2", f"threads={count}", "hydra.run.dir=run"],
        tmp_path, monkeypatch, jobs=True,
    )  # fmt: skip
    assert outcome.code == 2, outcome
    assert outcome.stderr.strip() == (
        f"mptrain: error: threads={count}: more than {threads.MAX_THREADS_PER_CPU} threads per "
        f"usable CPU ({affinity_cpus()} here): at most {most}, or threads=auto"
    )
    assert not (tmp_path / "run" / ".mptrain.lock").exists()


def test_omp_num_threads_far_beyond_the_cpus_is_refused_too(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    with pytest.raises(ConfigError, match=r"^OMP_NUM_THREADS=100000 in the environment: more"):
        threads.resolve_threads("auto", "cpu")
    most = threads.MAX_THREADS_PER_CPU * affinity_cpus()
    monkeypatch.setenv("OMP_NUM_THREADS", str(most))  # at the limit: respected
    assert threads.resolve_threads("auto", "cpu").threads == most


def test_a_number_of_a_hundred_thousand_digits_names_its_key(tmp_path, monkeypatch):
    outcome = run_cli(["model=mlp", f"seed={'9' * 100_000}"], tmp_path, monkeypatch)
    assert outcome.code == 2
    assert outcome.stderr.strip() == (
        "mptrain: error: seed=999999999999...: a number of 100,000 digits, beyond any "
        "setting's range"
    )
    refuse_huge_numbers(["seed=" + "9" * 100, "+model.x=-" + "1" * 100, "name=" + "a" * 500])
    with pytest.raises(ConfigError, match=r"^model\.x=-11111111111\.\.\.: a number of 101"):
        refuse_huge_numbers(["+model.x=-" + "1" * 101])


def test_epochs_whose_steps_pass_a_c_int_are_refused_before_training():
    with pytest.raises(ConfigError, match=r"^epochs=100000000: 2,200,000,000 steps of 22 per"):
        prepare_run(tiny_run("epochs=100000000"))
