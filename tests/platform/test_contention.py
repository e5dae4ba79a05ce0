"""The busy-machine guard (issue 29): a run's report, bench, advise and sweep comparisons say when
others' work competed for the cores, so a speed figure from a busy machine is not read as the
code's."""

from __future__ import annotations

import torch
from support.runs import tiny_run, train

from mptrain.platform import contention
from mptrain.platform.contention import LoadSample, judge
from mptrain.report.render import summary_rows
from mptrain.report.schema import load_report


def load(value: float | None, steal: int = 0, busy_time: int = 1000) -> LoadSample:
    """A sample with ``busy_time`` CPU ticks of user time and ``steal`` stolen ticks."""
    return LoadSample(value, (busy_time, 0, 0, 0, 0, 0, 0, steal), 0.0)


def test_a_quiet_machine_is_quiet_and_the_run_s_own_threads_are_not_others():
    verdict = judge(load(0.9), load(2.1, busy_time=2000), own_threads=2, cores=2)
    assert verdict["busy"] is False and verdict["others_load"] == 0.1
    assert verdict["words"] == "quiet (others' load ~0.1 on 2 cores)"


def test_others_load_or_steal_makes_it_busy():
    loaded = judge(load(3.5), load(4.0, busy_time=2000), own_threads=2, cores=2)
    assert loaded["busy"] and loaded["words"] == "busy: others' load ~2.5 on 2 cores"
    stolen = judge(load(0.0), load(0.0, steal=100, busy_time=2000), own_threads=1, cores=2)
    assert stolen["busy"] and stolen["steal_share"] == 0.0909
    assert stolen["words"] == "busy: others' load ~0.0 on 2 cores, 9% of CPU time stolen"


def test_without_counters_it_says_it_cannot_tell():
    verdict = judge(LoadSample(None, None, 0), LoadSample(None, None, 1), 1, 4)
    assert verdict["busy"] is False and verdict["words"].startswith("unknown")


def test_the_counters_are_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 20 30 40 50 60 70 80 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert contention.sample(stat).cpu_times == (10, 20, 30, 40, 50, 60, 70, 80, 0, 0)
    stat.write_text("garbage\n")
    assert contention.sample(stat).cpu_times is None


def test_a_run_on_a_busy_machine_says_so_in_its_report(tmp_path, monkeypatch):
    """The machine was measured busy (here: a load of 9 on the cores when the job started)."""
    real = contention.sample
    calls = []

    def busy_then_real(*args):
        calls.append(1)
        return LoadSample(9.0, None, 0.0) if len(calls) == 1 else real(*args)

    monkeypatch.setattr(contention, "sample", busy_then_real)
    train(tiny_run("max_steps=3", "epochs=null"), tmp_path)
    report = load_report(tmp_path / "report.json")
    assert report.hardware["machine_load"]["busy"] is True
    rows = dict(summary_rows(report))
    assert rows["machine"].startswith("busy: others' load ~")
    assert rows["machine"].endswith(": the speed figures are a busy machine's")
    assert "- machine load while it ran: busy:" in (tmp_path / "report.md").read_text()


def test_a_run_is_judged_against_its_own_threads_and_the_cores_it_may_use(monkeypatch):
    monkeypatch.setattr(contention, "affinity_cpus", lambda: 2)
    verdict = contention.judged_since(load(2.5), torch.device("cpu"))
    assert verdict["cores"] == 2 and verdict["others_load"] >= 1.5  # 2.5 less this process


# ----------------------------------------------------------- bench, advise and sweeps say so
BUSY = "busy: others' load ~3.0 on 2 cores"


def test_advise_calls_no_precision_faster_on_a_busy_machine_s_figures():
    from mptrain.commands.advise.decide import Context, Fidelity, Measured, Speed, recommend

    fp32 = Measured("fp32", speed=Speed(1.0, 1.0, 1.0), fidelity=Fidelity(40, 0.0, 0.0))
    bf16 = Measured("bf16", speed=Speed(1.8, 1.7, 1.9), fidelity=Fidelity(40, 0.01, 0.005))
    quiet = recommend([fp32, bf16], Context())
    assert quiet.precision == "bf16"
    busy = recommend([fp32, bf16], Context(busy=BUSY))
    assert busy.precision == "fp32"
    assert dict(busy.runners_up)["bf16"].startswith(
        f"speed not judged: measured on a busy machine ({BUSY})"
    )


def test_bench_marks_every_ratio_taken_on_a_busy_machine_noisy():
    from mptrain.commands import bench

    rep = {
        "step_time_ms": 1.0,
        "peak_memory_bytes": 1,
        "data_wait_fraction": 0.0,
        "host_syncs_per_step": 0,
        "label": "x",
    }
    rows = [
        bench.summarise(name, [{**rep, "samples_per_s": s} for s in speeds])
        for name, speeds in {"fp32": [100, 100, 100], "bf16": [200, 200, 200]}.items()
    ]
    bench.add_ratios(rows, busy=BUSY)
    assert (
        rows[1]["vs_fp32"] == 2 and rows[1]["vs_fp32_noisy"] == f"taken on a busy machine ({BUSY})"
    )


def test_a_sweep_speed_ratio_is_noisy_when_either_run_was_on_a_busy_machine(tmp_path):
    import dataclasses

    from mptrain.commands import sweep

    train(tiny_run("max_steps=12", "epochs=null", "log_every=2"), tmp_path)
    quiet = load_report(tmp_path / "report.json")
    quiet.hardware["machine_load"]["busy"] = False
    loaded = dataclasses.replace(
        quiet, hardware={**quiet.hardware, "machine_load": {"busy": True, "words": BUSY}}
    )
    alongside = {sweep._job(quiet): 0}
    assert "busy" not in (sweep.speed_spread(quiet, quiet, alongside).noisy or "")
    noisy = sweep.speed_spread(loaded, quiet, alongside).noisy
    assert f"this job ran on a busy machine ({BUSY})" in noisy
