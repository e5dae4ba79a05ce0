"""Graceful stop on SIGINT / SIGTERM: finish the current step, save, report, exit 130 / 143."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class Terminated(KeyboardInterrupt):
    """SIGTERM outside training: raised like Ctrl-C's KeyboardInterrupt, so both signals end a run
    alike (an ``interrupted`` report, then exit 128 + the signal number)."""

    signum = signal.SIGTERM

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def terminate_like_interrupt() -> None:
    """From now on (outside :class:`GracefulStop`), SIGTERM raises :class:`Terminated` instead of
    killing the process silently. Call it first thing in the entry point (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


class GracefulStop:
    """While active, SIGINT and SIGTERM only record that a stop was requested.

    The training loop polls :meth:`requested` after each step. A second signal during the final
    save does not interrupt the write (the first signal's number is the one reported). Outside
    the main thread (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def requested(self) -> bool:
        return self.signum is not None

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
