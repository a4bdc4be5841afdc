"""The error boundary of the ``grpoflow`` command: a grpoflow error prints what, where and what to do in two
lines and exits with its code; bugs keep their traceback."""

from __future__ import annotations

import logging
import sys

from flows.cli.common import app

WHAT_TO_DO = {
    2: "fix the input named above and run again",
    3: "the run stopped on purpose: see the message for what the data or rewards need",
    4: "fix the service, disk or lock named above; `grpoflow run --resume RUN_ID` continues a run",
}


class _NoUserErrorsOnConsole(logging.Filter):
    """Keep Prefect's log lines about a grpoflow error off the console: main() prints that error itself, in
    two lines (the Prefect UI still gets them, with the traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.errors import GrpoflowError

        return not (record.exc_info and isinstance(record.exc_info[1], GrpoflowError))


def main(argv: list[str] | None = None) -> None:
    """The ``grpoflow`` command: a grpoflow error prints what, where and what to do, and exits with its code
    (``tasks/errors.py``); ``--debug`` or ``GRPOFLOW_DEBUG=1`` shows the traceback instead."""
    import os

    from tasks.errors import GrpoflowError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("GRPOFLOW_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if not debug:  # Prefect's handlers exist once its logging is set up; later set-ups keep them
        from prefect.logging.configuration import setup_logging

        setup_logging()
        for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler):  # the console, not the API log handler
                    handler.addFilter(_NoUserErrorsOnConsole())
    try:
        app(args, prog_name="grpoflow")
    except GrpoflowError as exc:
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(f"error: {message}\n{WHAT_TO_DO.get(exc.exit_code, '')} (exit {exc.exit_code}; --debug "
                         "shows the traceback)\n")  # fmt: skip
        raise SystemExit(exc.exit_code) from None
