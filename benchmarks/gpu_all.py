"""Every GPU check of mptrain in one command, for the one shot a lent H200 gives (~8.5 min).

    python3 -m benchmarks.gpu_all [--out DIR] [--budget-s 510] [--skip-install] [--wheels DIR]
        [--pip-install] [--only STEP,...] [--python PYTHON] [--[no-]bundle] [--speed-s 165]
    python3 -m benchmarks.gpu_all --smoke [--out DIR]      # the same steps, tiny, on a CPU
    python3 -m benchmarks.gpu_all --fetch-wheels .whl      # beforehand, where PyPI is reachable

This is the runner; the runs are a table (benchmarks/gpu_runs.py: each step's argv, limit,
estimate, what it writes), setup comes first (benchmarks/gpu_setup.py), the summary after
(benchmarks/gpu_summary.py). Run it as one device-tool command with ``timeout_s`` 540
(DEVICE_TIMEOUT_S, of the 600 s a command may take): ``--budget-s`` (default 510) counts from
the start, setup included, and leaves ~30 s for the summary and the bundle. Each step is a
subprocess in its own process group, its limit cut to what is left of the budget; it starts only
when at least MIN_SHARE of its estimate is left, and with SIGINT at its default.

A step over its limit gets SIGINT (pytest then writes its JUnit XML; the scripts have their JSON
on disk already), SIGTERM halfway through KILL_GRACE_S, SIGKILL at its limit, all to its process
group; it is reported as timed out and the next one runs. Every step's JSON document is read
whatever its status (``partial`` unless the step ended ok). ``summary.json`` and ``summary.md``
are rewritten after every step, and when the driver gets SIGTERM or SIGINT (the device tool's
limit, a person): the running step's process group is stopped, its partial figures read, the
summary written and bundled, exit 143 (130). Written into ``--out`` (default: ``$OUT`` when set,
else benchmarks/results/gpu_<date>_<time>): ``<step>.log``, ``<step>.json``, pytest's JUnit XML
and the summaries; with ``--bundle`` (the default for ``$OUT``, whose files come back only eight
at a time) every file but the summaries and ``speed_table.md`` goes into gpu_all_files.tar.gz.
``--smoke`` runs on a CPU (tests/e2e/test_benchmarks.py). Exit code: 0 when every step that ran
succeeded, else 1. Standard library only: it runs before mptrain's dependencies exist.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks import gpu_runs, gpu_setup
from benchmarks.gpu_runs import SPEED_S, Step, child_env, plan
from benchmarks.gpu_summary import Outcome, bundle, collect, git_commit, write_summary
from benchmarks.jsondoc import first_line

KILL_GRACE_S = 10.0  # at a step's limit: SIGINT this long before it, SIGTERM halfway
STOP_GRACE_S = 3.0  # the same when the driver itself is stopped


class Terminated(Exception):
    """The driver got SIGTERM or SIGINT (the device tool's time limit, a person's Ctrl-C)."""


def on_signal(signum: int, frame: object) -> None:
    """Turn SIGTERM/SIGINT into :class:`Terminated`, once: a second signal is ignored while the
    driver stops the running step and writes its summary."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def run_command(argv: list[str], log: Path, timeout_s: float) -> tuple[int | None, str, float]:
    """Run ``argv`` in the repository root, stdout and stderr into ``log``: (exit code, status,
    wall seconds). It ends within ``timeout_s``: :func:`stop_group` starts a grace before it.
    :class:`Terminated` (the driver stopped) stops the group with a short grace and propagates."""
    start = time.perf_counter()
    grace = min(KILL_GRACE_S, timeout_s / 4)
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(
                argv, cwd=gpu_runs.REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_interrupt,
            )  # fmt: skip
        except OSError as exc:
            sink.write(f"cannot start: {exc}\n")
            return None, f"failed (cannot start: {exc.strerror})", time.perf_counter() - start
        try:
            code = proc.wait(timeout=timeout_s - grace)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            code = stop_group(proc, grace)
            sink.write(f"\n[gpu_all] stopped at its limit of {timeout_s:.0f} s\n")
            status = "timed out"
        except Terminated as exc:
            stop_group(proc, STOP_GRACE_S)
            sink.write(f"\n[gpu_all] stopped: the driver got {exc}\n")
            raise
        finally:
            signal_group(proc, signal.SIGKILL)  # what the step left running (workers)
    return code, status, time.perf_counter() - start


def default_interrupt() -> None:
    """In a step's process, before it runs its command: SIGINT back to its default. A driver
    started in the background by a non-interactive shell (``cmd &``, nohup) inherits SIGINT
    ignored, and so would every step: Python would then never raise KeyboardInterrupt, and a
    step stopped at its limit would be killed before writing its JSON or JUnit XML."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """``sig`` to the process group ``proc`` leads; False when the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGINT to the process group ``proc`` leads (pytest writes its JUnit XML, Python unwinds),
    SIGTERM after half of ``grace_s``, SIGKILL after the other half: the leader's exit code."""
    for sig, wait_s in ((signal.SIGINT, grace_s / 2), (signal.SIGTERM, grace_s / 2)):
        if not signal_group(proc, sig):
            return proc.poll()
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    signal_group(proc, signal.SIGKILL)
    return proc.wait()


class Budget:
    """Seconds left of the run's budget, counted from construction."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def setup(args: argparse.Namespace, out: Path, budget: Budget) -> Outcome:
    """The setup step (benchmarks/gpu_setup.py); its install runs through :func:`run_command`."""
    return gpu_setup.setup(args, out, budget.left(), run_command)


def run_step(step: Step, out: Path, budget: Budget) -> Outcome:
    """Run one step within its limit and the budget left (not at all with less than its
    ``start_s`` left), then read what it left behind (:func:`collect`)."""
    left = budget.left()
    if step.skip:
        return Outcome(step.name, step.what, f"not run ({step.skip})", estimate_s=step.estimate_s)
    if left < step.start_s():
        why = f"not run ({left:.0f} s of the budget left, {step.start_s():.0f} s needed to start)"
        return Outcome(step.name, step.what, why, estimate_s=step.estimate_s)
    for stale in filter(None, (step.json_out, step.junit)):  # an earlier run's, in this --out
        (out / stale).unlink(missing_ok=True)
    timeout_s = min(step.timeout_s, left)
    log = out / f"{step.name}.log"
    code, status, wall_s = run_command(step.argv, log, timeout_s)
    outcome = Outcome(step.name, step.what, status, code, wall_s, timeout_s, log.name)
    return collect(step, out, outcome)


# ---------------------------------------------------------------------------------------- main
class Driver:
    """One run: setup, then the planned steps; ``outcomes`` so far (steps not reached yet listed
    as ``not run yet``), written into the summary after every step and when stopped."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.start = time.perf_counter()
        self.budget = Budget(args.budget_s)
        self.commit = git_commit()
        self.outcomes: list[Outcome] = []
        self.steps: list[Step] = []
        self.running: tuple[Step, float] | None = None  # the step running and when it started
        self.stopped: str | None = None  # the signal that stopped the driver
        self.crashed: str | None = None  # the driver's own error, when it had one

    def run(self) -> None:
        """Setup, then every planned step (or those in ``--only``), printing each one's time."""
        self.outcomes.append(setup(self.args, self.out, self.budget))
        report(self.outcomes[0])
        has_timeout = gpu_setup.has_module(self.args.python, "pytest_timeout")
        timeout = gpu_runs.TEST_TIMEOUT_S if has_timeout else None
        self.steps = plan(
            self.args.python, self.out, self.args.smoke, timeout, speed_s=self.args.speed_s
        )
        if self.args.only:
            names = set(self.args.only.split(","))
            self.steps = [s for s in self.steps if s.name in names]
        for step in self.steps:
            if self.outcomes[0].status != "ok":
                outcome = Outcome(step.name, step.what, "not run (setup failed)")
            else:
                print(f"[gpu_all] {step.name}: {step.what} ...", flush=True)
                self.running = (step, time.perf_counter())
                outcome = run_step(step, self.out, self.budget)
                self.running = None
            self.outcomes.append(outcome)
            report(outcome)
            self.write()

    def stop(self, why: str) -> None:
        """After :class:`Terminated` or an error of the driver itself (``why``, in words): the
        step it interrupted (already stopped by run_command) is recorded with what it left."""
        status = f"stopped ({why})"
        if not self.outcomes:
            self.outcomes.append(Outcome("setup", gpu_setup.SETUP_WHAT, status, log="setup.log"))
        if self.running is not None:
            step, started = self.running
            wall_s = time.perf_counter() - started
            outcome = Outcome(step.name, step.what, status, None, wall_s, None, f"{step.name}.log")
            self.outcomes.append(collect(step, self.out, outcome))
            self.running = None

    def all_ok(self) -> bool:
        ran = [o for o in self.outcomes if not o.status.startswith("not run")]
        return not (self.stopped or self.crashed) and all(o.status == "ok" for o in ran)

    def meta(self) -> dict:
        if self.crashed:
            verdict = f"DRIVER ERROR ({self.crashed})"
        elif self.stopped:
            verdict = f"STOPPED (the driver got {self.stopped})"
        elif len(self.outcomes) <= len(self.steps):
            verdict = f"RUNNING ({len(self.outcomes)} of {len(self.steps) + 1} steps done)"
        else:
            verdict = "every step that ran succeeded" if self.all_ok() else "SOME STEPS FAILED"
        return {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "smoke": self.args.smoke,
            "verdict": verdict,
            "total_s": time.perf_counter() - self.start,
            "budget_s": self.args.budget_s,
            "device_timeout_s": gpu_runs.DEVICE_TIMEOUT_S,
            "python": self.args.python,
            "commit": self.commit,
        }

    def write(self) -> None:
        """The summary of what ran so far, with the steps not reached yet."""
        done = {o.name for o in self.outcomes}
        pending = [
            Outcome(s.name, s.what, "not run yet", estimate_s=s.estimate_s)
            for s in self.steps
            if s.name not in done
        ]
        write_summary(self.outcomes + pending, self.out, self.meta())


def report(outcome: Outcome) -> None:
    code = "" if outcome.exit_code is None else f", exit {outcome.exit_code}"
    print(f"[gpu_all] {outcome.name}: {outcome.status}{code}, {outcome.wall_s:.1f} s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else results/")
    parser.add_argument("--budget-s", type=float, default=None, help="default 510 (smoke: 240)")
    parser.add_argument("--smoke", action="store_true", help="every step tiny, on the CPU")
    parser.add_argument("--skip-install", action="store_true", help="never pip install")
    parser.add_argument("--wheels", type=Path, default=None, help="default: .whl/ when present")
    parser.add_argument("--pip-install", action="store_true", help="no wheels: pip from PyPI")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of every step")
    parser.add_argument("--bundle", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--only", default=None, help="comma-separated step names (a rerun)")
    parser.add_argument("--speed-s", type=float, default=SPEED_S, help="the speed table's limit")
    parser.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR")
    args = parser.parse_args(argv)
    from_env = args.out is None and bool(os.environ.get("OUT"))
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M")
        results = gpu_runs.REPO / "benchmarks" / "results"
        default = results / f"gpu_{'smoke_' if args.smoke else ''}{stamp}"
        args.out = Path(os.environ["OUT"]) if from_env else default
    args.bundle = from_env if args.bundle is None else args.bundle
    args.budget_s = args.budget_s or (gpu_runs.SMOKE_BUDGET_S if args.smoke else gpu_runs.BUDGET_S)
    if args.wheels is None and (gpu_runs.REPO / ".whl").is_dir():
        args.wheels = gpu_runs.REPO / ".whl"
    args.wheels = args.wheels.resolve() if args.wheels else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return gpu_setup.fetch_wheels(args.fetch_wheels, args.python)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Handlers, not SIG_IGN: the steps then start with SIGINT at its default (a background job
    # inherits it ignored, and a Python started so would ignore the SIGINT that stops it).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    driver = Driver(args, out)
    try:
        driver.run()
    except Terminated as exc:
        driver.stopped = str(exc)
        driver.stop(f"the driver got {exc}")
    except Exception as exc:  # a bug here must not cost the summary of what ran
        traceback.print_exc()
        driver.crashed = f"{type(exc).__name__}: {first_line(exc)}"
        driver.stop("the driver failed")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the summary and bundle take a second
        signal.signal(sig, signal.SIG_IGN)
    driver.write()
    if args.bundle:
        bundle(out)
    print((out / "summary.md").read_text())
    meta = driver.meta()
    print(f"[gpu_all] {meta['verdict']}; {meta['total_s']:.1f} s in all; summary: {out}/summary.md")
    if driver.stopped:
        return 128 + signal.Signals[driver.stopped].value
    return 0 if driver.all_ok() else 1


if __name__ == "__main__":
    raise SystemExit(main())
