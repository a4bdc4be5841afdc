"""vLLM's own log lines under grpoflow's console rules: vLLM's console handler is off (``VLLM_CONFIGURE_LOGGING=0``,
set in ``tasks/__init__.py``); its records go to a log file an engine names, and to the console only where the
console shows a library's chatter — every record under ``--verbose``, errors otherwise. Records written before an
engine names its file (vLLM logs while it is imported) are kept in a short buffer and written to the file first.
Python warnings raised in vLLM's code go the same way.
Must not import: vllm, torch, Prefect, MLflow, a stage.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from pathlib import Path

VLLM_LOGGER = "vllm"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_EARLY_RECORDS = 2000  # what vLLM logs while it is imported and configures itself is a few dozen records


class ConsoleRule(logging.Filter):
    """The console's rule for a library's records, read when each is written (the mode is chosen after import):
    every record under ``--verbose`` (``GRPOFLOW_CONSOLE=verbose``), errors only otherwise.

    >>> record = logging.LogRecord("vllm.config", logging.WARNING, __file__, 1, "chatter", None, None)
    >>> os.environ["GRPOFLOW_CONSOLE"] = "normal"; ConsoleRule().filter(record)
    False
    >>> os.environ["GRPOFLOW_CONSOLE"] = "verbose"; ConsoleRule().filter(record)
    True
    >>> del os.environ["GRPOFLOW_CONSOLE"]
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return os.environ.get("GRPOFLOW_CONSOLE") == "verbose" or record.levelno >= logging.ERROR


class VllmWarnings(logging.Filter):
    """On Python's ``py.warnings`` logger: a warning raised in vLLM's own code (a deprecation inside its kernels'
    dispatch) is vLLM's chatter, so it goes to the ``vllm`` logger instead.

    >>> path = os.path.join("site-packages", "vllm", "triton_utils", "dispatcher.py")
    >>> def warned(text): return logging.LogRecord("py.warnings", 30, "", 1, text, None, None)
    >>> VllmWarnings().filter(warned(f"{path}:138: FutureWarning: old")), VllmWarnings().filter(warned("x.py:1: W"))
    (False, True)
    """

    def filter(self, record: logging.LogRecord) -> bool:
        where = str(record.getMessage()).split(":", 1)[0]
        if f"{os.sep}vllm{os.sep}" not in where:
            return True
        logging.getLogger(f"{VLLM_LOGGER}.warnings").warning("%s", str(record.getMessage()).rstrip())
        return False


class _EarlyRecords(logging.Handler):
    """The last records written before a log file was named, handed to the first file handler."""

    def __init__(self) -> None:
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=_EARLY_RECORDS)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _own_handlers(logger: logging.Logger, kind: type) -> list[logging.Handler]:
    return [h for h in logger.handlers if isinstance(h, kind) and getattr(h, "grpoflow", False)]


def route_vllm_logging(log_file: Path | None = None, console_prefix: str = "") -> Path | None:
    """Send the ``vllm`` logger's records to ``log_file`` (appended, in place of an earlier file; the buffered
    early records first) and to the console under ``ConsoleRule``; ``console_prefix`` starts each console line
    (a rank's ``[rank 0] ``, which the launcher forwards). Idempotent: call it at import, and again once a file
    is known. Returns the file.

    >>> route_vllm_logging() is None, logging.getLogger("vllm").propagate
    (True, False)
    """
    logger = logging.getLogger(VLLM_LOGGER)
    warnings_logger = logging.getLogger("py.warnings")
    if not any(isinstance(f, VllmWarnings) for f in warnings_logger.filters):
        warnings_logger.addFilter(VllmWarnings())
    logger.propagate = False  # not through the root's console handler, which shows a library's warnings
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    consoles = _own_handlers(logger, logging.StreamHandler)
    consoles = [h for h in consoles if not isinstance(h, logging.FileHandler)]
    if not consoles:
        console = logging.StreamHandler(sys.stderr)
        console.grpoflow = True  # type: ignore[attr-defined]
        console.addFilter(ConsoleRule())
        logger.addHandler(console)
        consoles = [console]
    for console in consoles:
        console.setFormatter(logging.Formatter(console_prefix + _FORMAT))
    early = _own_handlers(logger, _EarlyRecords)
    if log_file is None:
        if not early and not _own_handlers(logger, logging.FileHandler):
            buffer = _EarlyRecords()
            buffer.grpoflow = True  # type: ignore[attr-defined]
            logger.addHandler(buffer)
        return None
    log_file = Path(log_file).absolute()
    if not any(Path(h.baseFilename) == log_file for h in _own_handlers(logger, logging.FileHandler)):
        for old in _own_handlers(logger, logging.FileHandler):  # one file: the run's that uses the engine now
            logger.removeHandler(old)
            old.close()
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file, encoding="utf-8")
        handler.grpoflow = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(_FORMAT))
        for buffer in early:
            for record in buffer.records:
                handler.handle(record)
            logger.removeHandler(buffer)
        logger.addHandler(handler)
    return log_file
