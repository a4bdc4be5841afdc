"""The console's one progress bar: a bar for long work (generation's prompts; the trainers draw their own), and
log lines written above a bar that is drawn instead of through it. Under ``grpoflow --quiet`` there is no bar;
while one bar is drawn, no second one starts (generation inside a training step adds none).
Must not import: torch, transformers, a stage."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# A log record with this attribute set repeats what the bar shows (a training step's loss and reward): the Prefect
# log and the log file keep it, the console shows it under --verbose only.
SHOWN_ON_THE_BAR = "shown_on_the_bar"
_drawing = 0  # bars open in this process (the trainer's included, through bar_safe_console)


def console_is_quiet() -> bool:
    """Whether this command runs under ``--quiet`` (``GRPOFLOW_CONSOLE=quiet``): no bar then."""
    return os.environ.get("GRPOFLOW_CONSOLE") == "quiet"


def _console_handlers() -> list[logging.StreamHandler]:
    """The stream handlers that write to the terminal (stdout or stderr), on any logger; not a log file's."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers: dict[int, logging.StreamHandler] = {}
    for each in loggers:
        for handler in getattr(each, "handlers", []):
            if (
                isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                and getattr(handler, "stream", None) in (sys.stdout, sys.stderr)
            ):
                handlers[id(handler)] = handler
    return list(handlers.values())


def _above_bars(handler: logging.StreamHandler, emit: Callable[[logging.LogRecord], None]) -> Callable:
    def write_above(record: logging.LogRecord) -> None:
        # Clear the bars on the terminal, write the line, draw the bars again under it.
        with tqdm.external_write_mode(file=handler.stream):
            emit(record)

    return write_above


@contextmanager
def bar_safe_console() -> Iterator[None]:
    """While a bar is drawn: every console log line clears it, is written, and the bar is drawn again below it,
    so the two never share a line. Leaves the handlers as it found them.

    >>> with bar_safe_console():
    ...     bar_is_drawn()
    True
    >>> bar_is_drawn()
    False
    """
    global _drawing
    wrapped = [h for h in _console_handlers() if "emit" not in vars(h)]  # not already wrapped (nested use)
    for handler in wrapped:
        handler.emit = _above_bars(handler, handler.emit)  # type: ignore[method-assign]
    _drawing += 1
    try:
        yield
    finally:
        _drawing -= 1
        for handler in wrapped:
            vars(handler).pop("emit", None)


def bar_is_drawn() -> bool:
    """Whether a bar is drawn in this process now (a second one would share its lines)."""
    return _drawing > 0


@contextmanager
def work_bar(total: int, description: str, unit: str = "item") -> Iterator[Callable[[int], None] | None]:
    """An ``advance(units)`` callback drawn as one bar of ``total`` units of work (a stage's jobs together), with
    the rate and time left, log lines above it; ``None`` under ``--quiet``, with nothing to count, or inside
    another bar. More units than ``total`` grow the bar."""
    if console_is_quiet() or total <= 0 or bar_is_drawn():
        yield None
        return
    bar: Any = tqdm(total=total, desc=description, unit=unit, leave=False, dynamic_ncols=True)

    def advance(units: int) -> None:
        if bar.n + units > bar.total:
            bar.total = bar.n + units
        bar.update(units)

    try:
        with bar_safe_console():
            yield advance
    finally:
        bar.close()
