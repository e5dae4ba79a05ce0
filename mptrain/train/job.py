"""One training run from a typed config: build it, train it, write its report.

:func:`train` is what the CLI calls for each Hydra job and what tests call directly. It takes plain
objects (a :class:`~mptrain.config.run.RunConfig` and an output directory) and never sees OmegaConf.
A :class:`Job` follows the run through its life (in order: ARCHITECTURE.md, the path of a run).
Whatever happens after the output directory is known — completion, divergence, an interrupt, an
exception — a report is written with the matching status before the exception (if any) propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from mptrain.checkpoint.checkpointer import Checkpointer, run_signature
from mptrain.checkpoint.file import resolve_resume
from mptrain.checkpoint.resume import AlreadyCompleted, resume_job
from mptrain.config.base import ConfigError
from mptrain.config.options import AUTO
from mptrain.config.run import RunConfig
from mptrain.models.build import compile_counts
from mptrain.output.joblog import JobLog, job_console
from mptrain.output.metrics import MetricsLog, read_metrics
from mptrain.output.plots import FigureWorker, plot_run
from mptrain.output.trackers import Trackers, start_trackers
from mptrain.pace import clocks
from mptrain.pace.progress import ProgressDisplay
from mptrain.pace.slowpath import check_slow_path
from mptrain.platform import contention
from mptrain.platform.distributed import DistContext, StartGate, init_distributed, shutdown
from mptrain.platform.launch import resume_after_restart
from mptrain.platform.signals import (
    CheckpointOnSignal,
    DeferredStop,
    GracefulStop,
    SignalsHeld,
    StopNow,
    Terminated,
)
from mptrain.precision.policy import PrecisionPolicy
from mptrain.report.assemble import assemble_report, now_iso
from mptrain.report.render import print_summary, summary_rows, write_report
from mptrain.report.schema import RunReport
from mptrain.rundir.layout import CHECKPOINT_DIR, METRICS_JSONL, RUN_PNG
from mptrain.rundir.lock import RunDirLock, check_no_other_run, check_output_dir
from mptrain.train import ranks
from mptrain.train.autoprecision import decide_auto
from mptrain.train.build import build_run, resolve_run
from mptrain.train.components import Run
from mptrain.train.diagnostics import write_diagnostics
from mptrain.train.faults import kill_observer
from mptrain.train.loop import LoopHooks, train_loop
from mptrain.train.memory import account_step
from mptrain.train.state import LoopState
from mptrain.train.threads import MIN_WINDOW_STEPS, ThreadTuner, kept_from_checkpoint


class RunInterrupted(RuntimeError):
    """Raised by :func:`train` after a SIGINT/SIGTERM stop: checkpoint and report are written."""

    def __init__(self, exit_code: int, report: RunReport) -> None:
        super().__init__(f"interrupted (exit code {exit_code})")
        self.exit_code = exit_code
        self.report = report


class RunFailed(RuntimeError):
    """Raised by :func:`train` after the report was written with status failed or diverged."""

    def __init__(self, status: str, reason: str, report: RunReport, written: bool = True) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.report = report
        self.written = written  # False: report.json could not be written (the reason says so)


def train(
    cfg: RunConfig,
    output_dir: Path,
    console: Console | None = None,
    on_owned: Callable[[], None] | None = None,
    jobs: int = 1,
) -> RunReport:
    """Run one job and write its report into ``output_dir``; return the report.

    ``jobs``: how many jobs run at once on this machine (a joblib sweep's ``n_jobs``):
    ``threads=auto`` divides the cores among them.

    ``on_owned`` is called once the run owns the directory: a fresh run once it holds the lock
    and no other run's work is there, a resumed one once its checkpoint was accepted (the CLI
    moves Hydra's record of the command into place then: mptrain.cli.record).

    Raises ConfigError (bad input found before training: no report is written), RunFailed (the
    run diverged or crashed; the report says why), RunInterrupted (SIGINT/SIGTERM during training:
    the step finished, a checkpoint and the report written), or KeyboardInterrupt (an interrupt
    outside training; report: interrupted).
    """
    d = cfg.distributed
    dist = init_distributed(cfg.device, d.strategy, d.reduce_dtype, d.timeout_s)
    cfg = dataclasses.replace(cfg, resume=resume_after_restart(cfg.resume, dist.launch.restart))
    gate = StartGate(dist)  # the other ranks go on once rank 0's checks below passed
    try:
        if not dist.is_main:  # rank 0 speaks for the job and owns its directory
            gate.wait()
            silent = JobLog(Console(quiet=True), enabled=False)
            return Job(cfg, output_dir, dist, silent, jobs=jobs).execute()
        # A stop signal from here until the job can report it is held, then raised inside the
        # job (Job.execute): an interrupted report once the run owns its directory, nothing
        # written in a directory it was refused.
        with DeferredStop() as early:
            check_output_dir(output_dir)
            # What the job says goes to stdout once and into the job's log (mptrain.output.joblog).
            with JobLog(console or job_console()) as log, RunDirLock(output_dir) as lock:
                if lock.stale_note:
                    log.say(lock.stale_note, "note")
                overwritten = check_no_other_run(output_dir, cfg.resume, cfg.overwrite)
                gate.open()
                if overwritten:
                    log.say(overwritten, "note")
                job = Job(cfg, output_dir, dist, log, on_owned, jobs=jobs)
                with FigureWorker() as job.figures:
                    return job.execute(early)
    except ConfigError as exc:
        gate.refuse(exc)  # rank 0 refused before the others went on: they stop with it
        raise
    finally:
        shutdown(dist)


class Job:
    """One job's life (see the module doc); always ends with a report once it has started."""

    def __init__(
        self,
        cfg: RunConfig,
        output_dir: Path,
        dist: DistContext,
        log: JobLog,
        on_owned: Callable[[], None] | None = None,
        jobs: int = 1,
    ) -> None:
        self.cfg, self.output_dir, self.dist = cfg, output_dir, dist
        self.jobs = jobs  # concurrent jobs on this machine (threads=auto divides the cores)
        self.on_owned = on_owned
        self.owned = False  # see _own
        self.log, self.console = log, log.console
        self.started_at = now_iso()
        self.start_time = time.perf_counter()
        self.load_at_start = contention.sample()
        self.compile_counts_at_start = compile_counts() if cfg.compile else None
        # Decided before the build, so a report of a failed build still names them.
        self.device = torch.device("cpu")
        self.policy: PrecisionPolicy | None = None
        self.tf32: dict[str, Any] | None = None
        self.run: Run | None = None
        self.resumed: dict[str, Any] | None = None
        self.checkpointer: Checkpointer | None = None
        self.stop: GracefulStop | None = None
        self.abandoned = False  # a second stop signal abandoned a step (_abandon_step)
        self.report_lost: str | None = None  # why report.json could not be written, if so
        self.trackers: Trackers | None = None
        self.figures: FigureWorker | None = None  # rank 0: draws curves.png
        self.display: ProgressDisplay | None = None  # rank 0: its estimate and notes (report)
        self.memory_accounted: dict[str, Any] | None = None  # one step's bytes (train.memory)
        self.words = ranks.LastWords(dist)  # this rank's last word; rank 0 reads the others'
        self.lost_ranks: dict[int, str] | None = None  # rank 0: the ranks that ended the run

    @property
    def state(self) -> LoopState:
        return self.run.state if self.run is not None else LoopState()

    def execute(self, early: DeferredStop | None = None) -> RunReport:
        """Prepare, train and report (see the module doc). ``early`` holds a stop signal that
        came before the job could report it: raised first thing, so it is reported here."""
        try:
            if not self.cfg.resume:  # train() took the directory: no other run's work is there
                self._own()
            else:  # its lines reach the directory's log once the checkpoint is accepted
                self.log.hold()
            if early is not None:
                early.release()
            self.words.say(ranks.TRAINING)
            self._prepare()
            with self._training() as hooks:
                try:
                    state = train_loop(self.run, hooks)
                except StopNow:  # a second signal: the step under way is abandoned
                    state = self._abandon_step()
                self._save_final(state)  # inside the signal handlers: a later signal waits
            self.words.say(f"ended at step {state.step}")
        except (ConfigError, AlreadyCompleted):  # nothing of this job's is written
            raise
        except KeyboardInterrupt as exc:
            name = exc.name if isinstance(exc, Terminated) else "interrupted"
            self.words.say(f"stopped: {name}")
            where = f"at step {self.state.step}" if self.run else "before training"
            self._report("interrupted", f"{name} {where}")
            raise
        except Exception as exc:
            with SignalsHeld():  # torchrun's agent stops the survivors meanwhile: report first
                reason = self._failure_reason(exc)
                report = self._report("failed", reason)
            if self.report_lost:  # e.g. the run directory became unwritable: say what is left
                reason = f"{reason}; {self.report_lost}"
            raise RunFailed("failed", reason, report, written=not self.report_lost) from exc
        return self._conclude()

    def _failure_reason(self, exc: Exception) -> str:
        """The report's reason for ``exc``; after a failed collective, rank 0 first names the
        rank that was lost, and how (:class:`mptrain.train.ranks.LastWords`)."""
        word = ranks.failure_word(exc)
        self.words.say(word)
        reason = f"{type(exc).__name__}: {exc}"
        if self.dist.enabled and self.dist.is_main and word.startswith(ranks.COLLECTIVE):
            self.lost_ranks = self.words.lost()
            if self.lost_ranks:
                reason = f"{ranks.lost_words(self.lost_ranks)}; {reason}"
        return reason

    def _prepare(self) -> None:
        cfg = self.cfg
        self.device, self.policy, self.tf32 = resolve_run(cfg, self.dist)
        self.run = run = build_run(
            cfg,
            self.device,
            self.policy,
            self.tf32,
            self.dist,
            jobs=self.jobs,
            measure_threads=True,
        )
        found = resolve_resume(cfg.resume, self.output_dir, cfg.overwrite) if cfg.resume else None
        if cfg.precision.name == AUTO:  # the rule's choice, or timed on the model, or resumed
            trained_in = found[1]["signature"].get("precision") if found else None
            run = self.run = decide_auto(run, run.settings.total_steps, trained_in, self._deciding)
            self.policy = run.precision.policy
        run.schedule.say = functools.partial(self.log.say, label="precision")  # at a switch
        run.threads = kept_from_checkpoint(run.threads, found)  # threads=auto, resumed
        if run.threads.measure:  # threads=auto on a CPU: measured on the first training steps
            say = functools.partial(self.log.say_in_log, label="threads")  # report: summary
            window = max(cfg.log_every, MIN_WINDOW_STEPS)
            run.monitor.threads = ThreadTuner(run.threads, window=window, say=say)
        self._announce()
        write_diagnostics(run, self.output_dir, self.console)
        if cfg.memory.account:
            self.memory_accounted = account_step(run)
        if cfg.resume:
            self.resumed = resume_job(found, cfg, self.run, self.output_dir, self.log)
            self._own()
        if cfg.checkpoint.enabled:
            signature = run_signature(cfg, run.precision, run.data.identity)
            self.checkpointer = Checkpointer(self.output_dir / CHECKPOINT_DIR, run, signature)

    def _deciding(self, line: str) -> None:
        """precision=auto starts timing its candidates (up to a minute): said before, and what a
        report written meanwhile (a stop) gives as the precision's reason."""
        self.log.say(line, "precision")
        stopped = f"{self.policy.reason}; stopped while precision=auto timed its candidates"
        self.policy = dataclasses.replace(self.policy, reason=stopped)

    def _own(self) -> None:
        """The run owns its directory from now on (see :func:`train`'s ``on_owned``): a fresh run
        from the start, a resumed one once its checkpoint was accepted. Before that, an outcome
        is not written there: the directory may hold a finished run's report."""
        self.owned = True
        self.log.release()
        if self.on_owned is not None and self.dist.is_main:
            self.on_owned()
            self.on_owned = None

    def _announce(self) -> None:
        run, policy = self.run, self.policy
        # precision=auto, or another tool's name (16-mixed): what was asked for, and why this ran
        why = "" if policy.requested == policy.name else f" ({policy.requested}: {policy.reason})"
        what = f"{self.cfg.model.name} on {run.data.description} | {policy.describe()}{why}"
        steps = run.settings
        what += f" | {steps.total_steps} steps ({steps.length})"
        self.log.say(
            f"mptrain {what} | {run.device} | run dir {self.output_dir}",
            markup=f"[bold]mptrain[/bold] {escape(what)} | {run.device} | run dir "
            f"{escape(str(self.output_dir))}",
        )
        for note in policy.notes:
            self.log.say(note, "note")

    @contextlib.contextmanager
    def _training(self) -> Iterator[LoopHooks]:
        """What the loop runs inside: the trackers, metrics.jsonl and the progress display (rank
        0), and the signal handlers of training; yields the loop's hooks."""
        cfg, run, checkpointer = self.cfg, self.run, self.checkpointer
        total, start = run.settings.total_steps, run.state.step
        if self.dist.is_main and cfg.logger:  # first: one that cannot start leaves nothing open
            precision = self.policy.name  # resolved by _prepare: what auto became
            self.trackers = start_trackers(cfg, precision, self.output_dir, start, self.log.warn)
        # Only rank 0 writes metrics and shows progress.
        metrics = MetricsLog(self.output_dir / METRICS_JSONL) if self.dist.is_main else None
        show = cfg.progress and self.dist.is_main
        label = f"{self.policy.name} {cfg.model.name}"
        # Before the display starts timing the run's first step: FP32's step, when it is needed.
        slow_path = check_slow_path(run) if self.dist.is_main else None
        display = ProgressDisplay(
            total, label, self.console, show, self.log, start, clocks.now, slow_path
        )
        if run.monitor.threads is not None:  # a new thread count: the estimate is made again
            run.monitor.threads.on_change = display.remeasure
        try:
            with display, self._stop_signals() as (stop, save):
                self.display = display
                self.stop = stop
                if checkpointer is not None:
                    checkpointer.asked = save.take
                killer = kill_observer(self.cfg.debug, self.dist.rank, self.dist.launch.restart)
                observers = (metrics, display, self.trackers, killer)
                yield LoopHooks(
                    observers=tuple(o for o in observers if o is not None),
                    checkpoint=checkpointer.after_step if checkpointer else None,
                    stop_requested=stop.requested,
                    stop_signal=lambda: stop.signum,
                    interruptible=stop.interruptible,
                )
        finally:
            if metrics:
                metrics.close()

    def _save_final(self, state: LoopState) -> None:
        """The final state (or the interrupted one) is always saved."""
        checkpointer = self.checkpointer
        ended = state.stopped or state.step == self.run.settings.total_steps
        if ended and checkpointer and state.step not in checkpointer.steps:
            checkpointer.save(state)

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[tuple[GracefulStop, CheckpointOnSignal]]:
        """The signal handlers of training: the stop signals (and the checkpoint signal with
        ``checkpoint.on_signal=stop``), and the checkpoint signal that saves and goes on. A
        distributed run stops only between steps: ranks abandoning different points of a step
        would wait on each other's collectives."""
        c = self.cfg.checkpoint
        signum = signal.Signals[c.signal] if c.signal else None
        stops = c.on_signal == "stop" and signum is not None
        say = functools.partial(self.log.say, label="signal")
        if self.checkpointer is None and not stops and signum is not None:
            say = functools.partial(_nothing_to_save, say)
        with (
            GracefulStop(
                say, stop_now=not self.dist.enabled, also=(signum,) if stops else ()
            ) as stop,
            CheckpointOnSignal(None if stops else signum, say) as save,
        ):
            yield stop, save

    def _abandon_step(self) -> LoopState:
        """After :class:`StopNow`: the loop's figures stop at the last completed step, whose
        weights and optimizer state the model still holds (the abandoned step's forward may have
        moved batch-norm statistics and the random state: said in the report)."""
        run = self.run
        run.monitor.end()
        run.state.stopped = True
        self.abandoned = True
        return run.state

    def _conclude(self) -> RunReport:
        """Report the run's outcome; raise for anything but a completed run."""
        state, diverged = self.run.state, self.run.monitor.diverged_reason
        if state.stopped and self.stop is not None:
            name = ranks.stop_words(state.stop_signals, self.dist.world_size) or self.stop.name
            saved = self.checkpointer is not None and state.step in self.checkpointer.steps
            where = f"{name} at step {state.step}"
            if self.abandoned and state.evaluating:  # step N finished: its state is exact
                where = (
                    f"{self.stop.both}: stopped at once, the evaluation after step "
                    f"{state.step} abandoned"
                )
            elif self.abandoned:
                where = (
                    f"{self.stop.both}: stopped at once, step {state.step + 1} abandoned (its "
                    f"forward had run: resuming from step {state.step} is not bit for bit)"
                )
            reason = f"{where}; " + (
                "checkpoint written, resume with resume=auto"
                if saved
                else "no checkpoint (checkpoint.enabled=false): progress is lost"
            )
            code = (
                self.stop.exit_code
                if self.stop.signum
                else ranks.stop_exit_code(state.stop_signals)
            )
            raise RunInterrupted(code, self._report("interrupted", reason))
        if diverged:
            raise RunFailed("diverged", diverged, self._report("diverged", diverged))
        return self._report("completed", None)

    def _report(self, status: str, reason: str | None) -> RunReport:
        """Build the report; rank 0 writes report.json, report.md and the curves. A stop signal
        meanwhile is noted and ignored: the report of a run that is ending is never cut short."""
        with SignalsHeld() as held:
            report = self._write_report(status, reason)
        if held.requested():
            self.log.warn(
                f"{held.name} while the report was written: ignored until it was complete"
            )
        return report

    def _write_report(self, status: str, reason: str | None) -> RunReport:
        report = assemble_report(self, status, reason)
        if not self.dist.is_main:
            return report  # only rank 0 writes
        if not self.owned:
            self.log.warn(
                f"{status} before its checkpoint was accepted: nothing written in "
                f"{self.output_dir}, which is as it was"
            )
            return report
        try:
            json_path, md_path = write_report(self.output_dir, report)  # first: it must exist
        except OSError as exc:  # e.g. a full disk: say what survived, in one line
            c = self.checkpointer
            kept = f"checkpoint {c.saved[-1]} (intact)" if c and c.saved else "no checkpoint"
            lost = f"report.json not written ({exc.strerror or exc}); kept: {kept}, {METRICS_JSONL}"
            self._finish_trackers("failed" if status == "completed" else status, [])
            if status == "completed":
                raise RunFailed("failed", lost, report) from exc
            # Another outcome is under way (its exception propagates): only say what was lost.
            self.log.warn(lost)
            self.report_lost = lost
            return report
        metrics_path = self.output_dir / METRICS_JSONL
        if metrics_path.is_file():
            title = (
                f"{report.precision.what_ran() or self.cfg.precision.name} {self.cfg.model.name}"
            )
            try:
                draw = self.figures.plot_run if self.figures else plot_run
                draw(read_metrics(metrics_path), title, self.output_dir / RUN_PNG)
                report.figure = RUN_PNG
                write_report(self.output_dir, report)
            except Exception as exc:  # a figure is not worth losing the run over; say so
                self.log.warn(f"curves.png not written: {exc}")
        figure = self.output_dir / report.figure if report.figure else None
        self._finish_trackers(status, [json_path, md_path, figure])
        print_summary(self.console, report, json_path)
        for key, value in summary_rows(report):  # the outcome, also in the job's log file
            self.log.record(f"summary: {key}: {value}")
        self.log.record(f"report: {json_path}")
        return report

    def _finish_trackers(self, status: str, artifacts: list[Path]) -> None:
        """The outcome and the report files to the trackers; a failure there is only warned of."""
        if self.trackers is not None:
            self.trackers.finish(status, [p for p in artifacts if p is not None])
            self.trackers = None


def _nothing_to_save(say: Callable[[str], None], message: str) -> None:
    """The checkpoint signal's announcement when checkpoint.enabled=false."""
    name = message.split(":", 1)[0]
    say(f"{name}: nothing to save (checkpoint.enabled=false); training goes on")
