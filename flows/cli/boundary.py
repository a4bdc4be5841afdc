"""The error boundary of the ``grpoflow`` command: a grpoflow error prints what, where and what to do in two
lines and exits with its code; bugs keep their traceback.
Must not import: a stage, torch or Prefect (it wraps every command, ``--help`` included).
"""

from __future__ import annotations

import logging
import sys

from flows.cli.common import CONSOLE_ENV, LibraryChatterFilter, app, notes, setup_logging

WHAT_TO_DO = {
    2: "fix the input named above and run again",
    3: "the run stopped on purpose: see the message for what the data or rewards need",
    4: "fix the service, disk or lock named above; `grpoflow run --resume RUN_ID` continues a run",
}


CONSOLE_FLAGS = {"--quiet": "quiet", "--verbose": "verbose"}
# What the console shows (the log file, MLflow and the Prefect UI get the same records whatever it is): quiet,
# warnings, errors and the command's result; normal, a line per stage and one progress bar; verbose, every record.
CONSOLE_LEVELS = {"quiet": logging.WARNING, "normal": logging.NOTSET, "verbose": logging.NOTSET}


def console_mode(args: list[str]) -> str:
    """``quiet``, ``normal`` or ``verbose``, from the command line (the last of ``--quiet``/``--verbose`` wins)
    or ``GRPOFLOW_CONSOLE``.

    >>> console_mode(["run", "--quiet"]), console_mode(["run"]), console_mode(["--quiet", "run", "--verbose"])
    ('quiet', 'normal', 'verbose')
    """
    import os

    chosen = [CONSOLE_FLAGS[a] for a in args if a in CONSOLE_FLAGS]
    mode = chosen[-1] if chosen else os.environ.get(CONSOLE_ENV, "normal")
    return mode if mode in CONSOLE_LEVELS else "normal"


class _NoUserErrorsOnConsole(logging.Filter):
    """Keep Prefect's log lines about a grpoflow error off the console: main() prints that error itself, in
    two lines (the Prefect UI still gets them, with the traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.errors import GrpoflowError

        return not (record.exc_info and isinstance(record.exc_info[1], GrpoflowError))


def main(argv: list[str] | None = None) -> None:
    """The ``grpoflow`` command: a grpoflow error prints what, where and what to do, and exits with its code
    (``tasks/errors.py``); ``--debug`` or ``GRPOFLOW_DEBUG=1`` shows the traceback instead."""
    import atexit
    import gc
    import os

    # The last exit handler (they run last registered first): once Prefect's and MLflow's have stopped servers
    # and flushed, the objects left are frozen, so the interpreter's final collections skip them instead of
    # walking the whole stack's heap (4 s after every command that loaded torch, transformers and Prefect).
    atexit.register(gc.freeze)
    from tasks.errors import GrpoflowError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("GRPOFLOW_DEBUG", "") not in ("", "0")
    mode = console_mode(args)
    before = os.environ.get(CONSOLE_ENV)
    os.environ[CONSOLE_ENV] = mode  # the trainers (and ranks a launcher starts) read it for their progress bar
    args = [a for a in args if a not in ("--debug", *CONSOLE_FLAGS)]
    from prefect.logging.configuration import setup_logging as setup_prefect_logging

    notes.quiet = mode == "quiet"  # which config, store and server a command used: not under --quiet
    setup_prefect_logging()  # Prefect's handlers exist once its logging is set up; later set-ups keep them
    setup_logging()  # every command: the libraries' chatter (Great Expectations, alembic, httpx) off the console
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):  # the console, not the API log handler
                if not debug:
                    handler.addFilter(_NoUserErrorsOnConsole())
                handler.setLevel(CONSOLE_LEVELS[mode])
                if mode != "verbose":
                    handler.addFilter(LibraryChatterFilter())
    try:
        app(args, prog_name="grpoflow")
    except GrpoflowError as exc:
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(
            f"error: {message}\n{WHAT_TO_DO.get(exc.exit_code, '')} (exit {exc.exit_code}; --debug "
            "shows the traceback)\n"
        )
        raise SystemExit(exc.exit_code) from None
    finally:  # main() called in-process (tests, notebooks) leaves the console as it found it
        if before is None:
            os.environ.pop(CONSOLE_ENV, None)
        else:
            os.environ[CONSOLE_ENV] = before
        notes.quiet = False
