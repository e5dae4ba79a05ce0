"""Graceful stop on SIGINT / SIGTERM / SIGHUP: finish the current step, save, report, exit
128 + the signal number (130 / 143 / 129).

SIGHUP (a closed terminal, a dropped ssh session) is handled like SIGTERM: Python's default would
end the process with no checkpoint and no report. While the report is written
(:class:`SignalsHeld`), further signals are recorded and otherwise ignored: a burst of SIGTERMs
(``timeout -k``, schedulers, impatient users) cannot cut the report short."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

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
    instead of killing the process silently. Call it first thing in the entry point (main thread
    only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _TERMINATING:
            signal.signal(sig, _raise_terminated)


class GracefulStop:
    """While active, SIGINT, SIGTERM and SIGHUP only record that a stop was requested.

    The training loop polls :meth:`requested` after each step. A second signal during the final
    save does not interrupt the write (the first signal's number is the one reported). Outside
    the main thread (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.signum: int | None = None
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

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class SignalsHeld(GracefulStop):
    """While active, SIGINT, SIGTERM and SIGHUP are recorded (``signum``: the first) and otherwise
    ignored, so what runs inside finishes: the report of a run that is ending anyway. The process
    exits as soon as it is written, with the outcome the report states."""


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
