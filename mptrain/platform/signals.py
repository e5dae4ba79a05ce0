"""Graceful stop on SIGINT / SIGTERM / SIGHUP (:class:`GracefulStop`: finish the current step,
save, report, exit 128 + the signal number), the checkpoint signal (:class:`CheckpointOnSignal`),
and stop signals held while the report is written (:class:`SignalsHeld`). SIGHUP (a closed
terminal, a dropped ssh session) is handled like SIGTERM: Python's default would end the process
with no checkpoint and no report."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from types import FrameType

# The signals that stop a run gracefully; SIGINT raises KeyboardInterrupt by Python's default.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside training: raised like Ctrl-C's KeyboardInterrupt, so every stop
    signal ends a run alike (an ``interrupted`` report, then exit 128 + the signal number)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def terminate_like_interrupt() -> None:
    """From now on (outside :class:`GracefulStop`), SIGTERM and SIGHUP raise :class:`Terminated`
    instead of killing the process silently, and SIGUSR1/SIGUSR2 are ignored. Call it first thing
    in the entry point (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _TERMINATING:
            signal.signal(sig, _raise_terminated)
        for sig in CHECKPOINT_SIGNALS_IGNORED:  # their default would end the process
            signal.signal(sig, _ignored)


# Checkpoint signals (checkpoint.signal) outside training, where there is nothing to save yet or
# any more: ignored, where Python's default would end the process without a word.
CHECKPOINT_SIGNALS_IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def _ignored(signum: int, frame: FrameType | None) -> None:
    pass


class SignalsHeld:
    """While active, SIGINT, SIGTERM and SIGHUP are recorded (``signum``: the first) and otherwise
    ignored, so what runs inside finishes: the report of a run that is ending anyway. The process
    exits as soon as it is written, with the outcome the report states. Outside the main thread
    (where Python cannot install handlers) it does nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.signals: tuple[int, ...] = STOP_SIGNALS
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        """The recorded signal's name (``SIGTERM``), None before one came."""
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + signal number: 130 for SIGINT, 143 for SIGTERM (the shell convention)."""
        return 128 + (self.signum or 0)

    def __enter__(self) -> SignalsHeld:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class StopNow(Terminated):
    """A second stop signal during a step: the step is abandoned where it is (only inside
    :meth:`GracefulStop.interruptible`, where the weights and optimizer state are still the last
    completed step's)."""


class GracefulStop(SignalsHeld):
    """While active, SIGINT, SIGTERM and SIGHUP (and ``also``: the checkpoint signal when
    ``checkpoint.on_signal=stop``) ask the run to stop after the current step: the training loop
    polls :meth:`requested` after each step, and ``announce`` says so at once ("stopping after
    this step"). With ``stop_now``, a second signal stops at once: :class:`StopNow` is raised
    inside :attr:`interruptible` (forward, backward, evaluation), or as soon as the step enters
    it; elsewhere (the optimizer's update, a checkpoint write) the step finishes first. The first
    signal's number is the one reported.
    """

    def __init__(
        self,
        announce: Callable[[str], None] | None = None,
        stop_now: bool = True,
        also: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.announce = announce
        self.stop_now = stop_now
        self.signals = (*STOP_SIGNALS, *also)
        self.now = False  # a second signal came: stop at once
        self.second: int | None = None  # that second signal's number
        self.interruptible = _Interruptible(self)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            _say(self.announce, f"{self.name}: stopping after this step{self._again()}")
        elif self.stop_now and not self.now:
            self.now, self.second = True, signum
            _say(self.announce, f"{self.both}: stopping now")
            if self.interruptible.active:
                raise StopNow(self.signum)

    @property
    def both(self) -> str:
        """The two stop signals in words: ``SIGINT twice``, ``SIGINT then SIGTERM``."""
        if self.second is None or self.second == self.signum:
            return f"{self.name} twice"
        return f"{self.name} then {signal.Signals(self.second).name}"

    def _again(self) -> str:
        if not self.stop_now:
            return ""
        again = "Ctrl-C" if self.signum == signal.SIGINT else self.name
        return f" ({again} again to stop now)"


class _Interruptible:
    """Where a second stop signal may abandon the step (see :class:`GracefulStop`); reusable and
    cheap to enter (it runs every step)."""

    def __init__(self, stop: GracefulStop) -> None:
        self.stop = stop
        self.active = False

    def __enter__(self) -> None:
        self.active = True
        if self.stop.now:  # the second signal came outside: stop as the step enters here
            self.active = False
            raise StopNow(self.stop.signum)

    def __exit__(self, *exc: object) -> None:
        self.active = False


class CheckpointOnSignal:
    """While active, ``signum`` (``checkpoint.signal``: SIGUSR1 by default, what SLURM's
    ``--signal=USR1@T`` sends before pre-empting a job) asks for a checkpoint after the current
    step, and training goes on: :meth:`take` answers once per signal. ``announce`` says so."""

    def __init__(self, signum: int | None, announce: Callable[[str], None] | None = None) -> None:
        self.signum = signum
        self.announce = announce
        self.pending = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True
        _say(
            self.announce,
            f"{signal.Signals(signum).name}: a checkpoint after this step; training goes on",
        )

    def take(self) -> bool:
        """Whether a checkpoint was asked for since the last call."""
        pending, self.pending = self.pending, False
        return pending

    def __enter__(self) -> CheckpointOnSignal:
        if self.signum is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self._previous = None


class DeferredStop(SignalsHeld):
    """Holds stop signals over a stretch that cannot yet report them (a run taking its directory
    and starting its helpers), then :meth:`release` raises the first one where it can be: as
    Ctrl-C's KeyboardInterrupt or :class:`Terminated`, so the run ends with an ``interrupted``
    report. Left without a release (the run was refused), the signal is dropped with the run."""

    def release(self) -> None:
        """Restore the handlers; raise the signal that came meanwhile, if any."""
        self.__exit__(None, None, None)
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise Terminated(self.signum)


def _say(announce: Callable[[str], None] | None, message: str) -> None:
    """``announce(message)`` from a signal handler: a write the signal interrupted on the same
    stream makes it reentrant (RuntimeError), and then the message is dropped, not the run."""
    if announce is not None:
        with contextlib.suppress(RuntimeError):
            announce(message)
