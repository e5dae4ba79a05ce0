"""What a job says, printed once to stdout and recorded in the job's log file.

A run's story (the announce line, notes, warnings, progress lines, evaluations, the outcome) goes
two ways:

- to stdout through a rich :class:`~rich.console.Console`. On a terminal that is rich's usual
  console (colours, the live progress bar); anywhere else (``> train.log``, ``| tee``, nohup,
  SLURM) it is :func:`job_console`'s plain console: no escape codes, no wrapping at 80 columns, no
  "…" inside a table cell, one line per message.
- to the ``mptrain`` logger, whose records go only to the *file* handlers of the root logger
  (Hydra's default ``hydra/job_logging`` writes ``<run dir>/<job name>.log``), never to a
  stdout/stderr stream handler: the console already showed the line, so nothing appears twice.

:class:`JobLog` attaches those handlers for one job and detaches them after it, so each job of a
``-m`` sweep writes to its own log file (Hydra configures logging per job). torchrun ranks > 0 run
with Hydra's logging disabled and a quiet console: they say nothing.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

LOGGER = logging.getLogger("mptrain")
# Wide enough that no line or table row wraps; rich lays a table out to its content, not to this.
PLAIN_WIDTH = 100_000


def job_console() -> Console:
    """rich's console on a terminal; elsewhere one that writes each message as one plain line."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=PLAIN_WIDTH, soft_wrap=True, highlight=False, emoji=False)


def table_console(min_width: int) -> Console:
    """The console for a command's tables: on a terminal its own width (a wide table folds its
    cells to fit, as :func:`print_table` draws it); off a terminal at least ``min_width`` wide
    (tables are plain text there, whole rows; other lines are not cut at 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(min_width, console.width))


def print_table(
    console: Console,
    title: str,
    headers: list[str],
    rows: list[list[str]],
    whole: frozenset[str] = frozenset(),
) -> None:
    """A table of text cells: on a terminal a rich table (columns named in ``whole`` never wrap,
    the others fold); anywhere else (``> sweep.log``, ``| tee``, SLURM's output file) the
    :func:`plain_table` text, which a log file shows as written (box drawings do not survive
    every viewer, and a folded cell breaks grep)."""
    if not console.is_terminal:
        console.out(plain_table(title, headers, rows), highlight=False)
        return
    table = Table(title=escape(title))
    for header in headers:
        table.add_column(escape(header), no_wrap=header in whole, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))  # cells are text, never rich markup
    console.print(table)


# A cell longer than this (a diverged job's reason) goes below a plain table as a numbered note,
# so one long cell does not make every row of the table that wide.
MAX_PLAIN_CELL = 48


def plain_table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """``title``, then the header and one line per row, columns padded with spaces to their
    widest cell and two spaces apart; no trailing spaces. A cell longer than MAX_PLAIN_CELL is
    replaced by ``[N]`` and given whole as note N below the table."""
    notes: list[str] = []

    def short(cell: str) -> str:
        if len(cell) <= MAX_PLAIN_CELL:
            return cell
        notes.append(cell)
        return f"[{len(notes)}]"

    rows = [[short(cell) for cell in row] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join([title, *lines, *(f"[{n}] {note}" for n, note in enumerate(notes, 1))])


def record_error(message: str) -> None:
    """``error: message`` into the run's log files only (Hydra's ``<job>.log``; the terminal got
    the line already): a job refused after Hydra made its directory leaves why there, not an
    empty log."""
    record = LOGGER.makeRecord(
        LOGGER.name, logging.ERROR, __file__, 0, f"error: {message}", (), None
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _stop_quietly_on_error(handler: logging.Handler) -> None:
    """A log file that cannot be written (a full disk) is said once, in one line, and no longer
    written: logging's default prints a "--- Logging error ---" traceback for every line, which
    buried the run's own one-line error under screens of them."""

    def handle_error(record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        handler.setLevel(logging.CRITICAL + 1)  # nothing more reaches it
        where = getattr(handler, "baseFilename", type(handler).__name__)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"mptrain: warning: {where}: no longer written ({reason})", file=sys.stderr)

    handler.handleError = handle_error  # type: ignore[method-assign]


def _is_console_stream(handler: logging.Handler) -> bool:
    """A handler writing to stdout or stderr (Hydra's ``console`` handler, for one)."""
    if isinstance(handler, logging.FileHandler):
        return False
    stream = getattr(handler, "stream", None)
    return stream is not None and stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


class JobLog:
    """One job's story (see the module doc). Disabled (ranks > 0), it prints and records nothing.

    Use as a context manager around the job: inside it the ``mptrain`` logger writes to the root
    logger's non-console handlers; outside it, the logger is as it was.
    """

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self._saved: tuple[bool, list[logging.Handler], int, bool] | None = None
        self._held: list[tuple[int, str]] | None = None  # see hold()

    def __enter__(self) -> JobLog:
        if self.enabled:
            self._saved = (LOGGER.propagate, list(LOGGER.handlers), LOGGER.level, LOGGER.disabled)
            handlers = [h for h in logging.getLogger().handlers if not _is_console_stream(h)]
            for handler in handlers:
                _stop_quietly_on_error(handler)
            LOGGER.handlers = handlers
            LOGGER.propagate = False  # the root's console handler would print the line again
            LOGGER.setLevel(logging.INFO)
            LOGGER.disabled = False  # a dictConfig that disabled existing loggers: still record
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            LOGGER.propagate, LOGGER.handlers, level, LOGGER.disabled = self._saved
            LOGGER.setLevel(level)
            self._saved = None

    def hold(self) -> None:
        """Keep records back until :meth:`release`: a resume that may be refused must not add
        its lines to the log of the run that owns the directory."""
        self._held = []

    def release(self) -> None:
        """Write the records held back (the job owns its directory now) and stop holding."""
        held, self._held = self._held, None
        for level, text in held or ():
            LOGGER.log(level, text)

    def record(self, text: str, level: int = logging.INFO) -> None:
        """Into the log file only (the terminal shows it another way, e.g. the live bar)."""
        if not self.enabled:
            return
        if self._held is not None:
            self._held.append((level, text))
        else:
            LOGGER.log(level, text)

    def say_in_log(self, text: str, label: str | None = None) -> None:
        """``label: text`` into the log file only: detail of a setting the user may never have
        touched (threads=auto's measurements), which the summary and report sum up."""
        self.record(f"{label}: {text}" if label else text)

    def say(self, text: str, label: str | None = None, markup: str | None = None) -> None:
        """Print ``label: text`` (the label in yellow on a terminal) and record it.

        ``markup``: the console's rich-markup form of the same line, when it has one; ``text``
        is always printed literally (paths and messages are never read as markup).
        """
        if not self.enabled:
            return
        shown = markup if markup is not None else escape(text)
        if label:
            shown = f"[yellow]{label}:[/yellow] {shown}"
        self.console.print(shown)
        self.record(f"{label}: {text}" if label else text)

    def warn(self, text: str) -> None:
        """A warning: printed once and recorded at WARNING level."""
        if self.enabled:
            self.console.print(f"[yellow]warning:[/yellow] {escape(text)}")
            self.record(f"warning: {text}", logging.WARNING)
