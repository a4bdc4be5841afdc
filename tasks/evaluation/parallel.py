"""Jobs on both halves of the machine (evaluation's sampling and forgetting check of each model, the probes' batches):
this process and one forked worker, each with half the torch threads, take the next job whose dependencies are done.
On a small CPU, one model's decoding does not keep two threads busy (docs/measurements/performance.md: sampling runs
1.5× faster on two threads than on one, the likelihood passes 1.8×), so two jobs side by side finish sooner than
each on both threads in turn.

A job's result does not depend on the process or the thread count it ran with (tested: the evaluation table is
the same to the bit with one process or two). The worker is forked when the jobs start, so it shares everything
imported and loaded so far, and leaves with ``os._exit`` (no exit handlers of the parent's run). Its log records
and progress come back over its pipe and are handled here, in the stage's process. A job that fails raises here;
a worker that dies leaves its job to this process.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# A job's progress: ``report(units)`` adds ``units`` to the stage's bar.
Report = Callable[[int], None]


@dataclass(frozen=True)
class Job:
    """One piece of work: ``run(report)`` returns its result; ``after`` names the jobs that must finish first."""

    name: str
    run: Callable[[Report], Any]
    after: tuple[str, ...] = ()


class JobFailed(RuntimeError):
    """A job raised in the worker process: its traceback is the message."""


def processes_for(setting: int | str, jobs: int, cpu_only: bool, threads: int | None = None) -> int:
    """How many processes run ``jobs`` jobs: one where the models do not run on the CPU (a forked CUDA or vLLM
    engine is not usable) or this system cannot fork; else ``setting`` when it is a number, or (``auto``) two where
    there are two jobs or more and torch has two threads or more to share; never more processes than jobs.

    >>> processes_for("auto", 6, True, 2), processes_for("auto", 6, True, 1), processes_for("auto", 6, False, 8)
    (2, 1, 1)
    >>> processes_for(1, 6, True, 2), processes_for(2, 1, True, 2), processes_for(2, 6, False, 2)
    (1, 1, 1)
    """
    if not cpu_only or not _can_fork():
        return 1
    if setting != "auto":
        return max(1, min(int(setting), 2, jobs))
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return 2 if jobs >= 2 and threads >= 2 else 1


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def run_jobs(jobs: Sequence[Job], processes: int = 1, report: Report | None = None) -> dict[str, Any]:
    """Each job's result by name. Jobs start in list order, each once its ``after`` jobs are done; with
    ``processes`` 2, a forked worker takes jobs too and both processes use half the torch threads.

    >>> order = []
    >>> jobs = [Job("b", lambda r: order.append("b") or 2, after=("a",)), Job("a", lambda r: order.append("a") or 1)]
    >>> run_jobs(jobs), order
    ({'a': 1, 'b': 2}, ['a', 'b'])
    """
    names = [job.name for job in jobs]
    missing = {dep for job in jobs for dep in job.after} - set(names)
    if len(set(names)) != len(names) or missing:
        raise ValueError(f"job names must be unique and dependencies known: {names}, unknown {sorted(missing)}")
    board = _Board(list(jobs), report or (lambda units: None))
    if processes <= 1 or len(jobs) < 2:
        board.run_here()
        board.raise_failure()
        return board.results
    import torch

    threads = torch.get_num_threads()
    share = max(1, threads // 2)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    worker = context.Process(target=_worker, args=(list(jobs), theirs, share), name="grpoflow-worker", daemon=True)
    try:
        worker.start()
    except OSError as exc:  # no memory or processes left for a fork: one process does it all
        logger.warning("could not fork a worker (%s): one process runs every job", exc)
        board.run_here()
        board.raise_failure()
        return board.results
    torch.set_num_threads(share)
    try:
        theirs.close()
        board.worker_alive = True  # before this process takes a job: it must not take the whole machine
        listener = threading.Thread(target=board.serve, args=(ours, worker), daemon=True)
        listener.start()
        logger.info(
            "%d jobs (%s, ...) in 2 processes, %d torch thread%s each",
            len(jobs),
            jobs[0].name,
            share,
            "" if share == 1 else "s",
        )
        board.run_here(whole=threads)
        if board.failure is not None:  # a job failed: the worker's job is not waited for
            worker.kill()
        listener.join()
    finally:
        torch.set_num_threads(threads)
        if worker.is_alive():
            worker.kill()
        worker.join()
        ours.close()
    board.raise_failure()
    return board.results


class _Board:
    """Which jobs are pending, running and done, shared by this process's loop and the worker's listener."""

    def __init__(self, jobs: list[Job], report: Report) -> None:
        self.jobs = jobs
        self.pending = list(range(len(jobs)))
        self.done: set[str] = set()
        self.results: dict[str, Any] = {}
        self.failure: BaseException | None = None
        self.worker_alive = False
        self.changed = threading.Condition()
        self._report = report

    def report(self, units: int) -> None:
        with self.changed:  # the bar is drawn from both threads
            self._report(units)

    def _next(self) -> int | None:
        """The first pending job whose dependencies are done, taken off the list; waits while pending jobs wait
        on running ones; None when nothing is left or a job failed. Call with ``changed`` held."""
        while self.pending and self.failure is None:
            for index in self.pending:
                if set(self.jobs[index].after) <= self.done:
                    self.pending.remove(index)
                    return index
            self.changed.wait()
        return None

    def _finish(self, index: int, result: Any, seconds: float, where: str = "") -> None:
        logger.debug("job %s done in %.1f s%s", self.jobs[index].name, seconds, where)
        self.results[self.jobs[index].name] = result
        self.done.add(self.jobs[index].name)
        self.changed.notify_all()

    def _fail(self, failure: BaseException) -> None:
        self.failure = self.failure or failure
        self.changed.notify_all()

    def run_here(self, whole: int | None = None) -> None:
        """Take and run jobs in this process until none is left (then wait for the worker's last one). With
        ``whole``: the torch threads to go back to once the worker is gone."""
        while True:
            with self.changed:
                # Nothing to take while the worker runs the last jobs: wait for them, or for a dead worker's job.
                while (index := self._next()) is None and self.worker_alive and self.failure is None:
                    if len(self.done) == len(self.jobs):
                        return
                    self.changed.wait()
                if index is None:
                    return
                alone = whole is not None and not self.worker_alive
            if alone:
                import torch

                torch.set_num_threads(whole)
            started = time.perf_counter()
            try:
                result = self.jobs[index].run(self.report)
            except BaseException as exc:  # noqa: BLE001 - raised again by the caller, after the worker stops
                with self.changed:
                    self._fail(exc)
                return
            with self.changed:
                self._finish(index, result, time.perf_counter() - started)

    def serve(self, connection: Any, worker: Any) -> None:
        """The worker's side, in a thread of this process: hand it jobs, take its results, log lines and
        progress; a worker that dies puts its job back for this process."""
        index = None
        try:
            while True:
                with self.changed:
                    index = self._next()
                connection.send(index)
                if index is None:
                    return
                while True:
                    kind, payload = connection.recv()
                    if kind == "progress":
                        self.report(payload)
                    elif kind == "log":
                        _handle(payload)
                    else:
                        break
                with self.changed:
                    if kind == "done":
                        self._finish(index, payload[0], payload[1], " (worker)")
                    else:
                        self._fail(JobFailed(f"job {self.jobs[index].name} failed in the forked worker:\n{payload}"))
                index = None
        except (EOFError, OSError) as exc:
            worker.join(timeout=5)  # its exit code, for the message
            with self.changed:
                if index is not None:
                    self.pending.insert(0, index)
                if self.failure is None:
                    logger.warning(
                        "the forked worker stopped (%s, exit code %s): this process goes on alone",
                        type(exc).__name__,
                        worker.exitcode,
                    )
        finally:
            with self.changed:
                self.worker_alive = False
                self.changed.notify_all()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


def _handle(record: logging.LogRecord) -> None:
    """A worker's log record, handled here as if logged here (the stage's handlers: console, file, Prefect)."""
    target = logging.getLogger(record.name)
    if target.isEnabledFor(record.levelno):
        target.handle(record)


class _PipeHandler(logging.Handler):
    """The worker's only log handler: each record, its message formatted, sent to the stage's process."""

    def __init__(self, connection: Any, lock: threading.Lock) -> None:
        super().__init__()
        self.connection, self.sending = connection, lock  # not ``lock``: Handler's own, which handle() takes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None
            record.exc_text = record.exc_text or (self.format(record) if record.exc_info else None)
            record.exc_info = None
            with self.sending:
                self.connection.send(("log", record))
        except Exception:  # noqa: BLE001 - a lost log line must not fail a job
            pass


def _worker(jobs: list[Job], connection: Any, threads: int) -> None:
    """The forked worker: jobs by index from ``connection`` until None, each answered with its result or its
    traceback. Leaves with ``os._exit``: the run's exit handlers belong to the stage's process."""
    code = 0
    try:
        import torch

        torch.set_num_threads(threads)
        lock = threading.Lock()
        root = logging.getLogger()
        for each in [root, *logging.Logger.manager.loggerDict.values()]:  # the parent's handlers stay there
            for handler in list(getattr(each, "handlers", [])):
                each.removeHandler(handler)
        root.addHandler(_PipeHandler(connection, lock))

        def report(units: int) -> None:
            with lock:
                connection.send(("progress", units))

        while (index := connection.recv()) is not None:
            started = time.perf_counter()
            try:
                result = jobs[index].run(report)
            except KeyboardInterrupt:  # Ctrl-C reached the whole process group: the stage's process raises it
                raise
            except BaseException:  # noqa: BLE001 - sent to the stage's process, which raises it
                with lock:
                    connection.send(("error", traceback.format_exc()))
                continue
            with lock:
                connection.send(("done", (result, time.perf_counter() - started)))
    except (EOFError, OSError, KeyboardInterrupt):
        code = 1
    finally:
        from reward_fns.code import close_process_sandboxes

        close_process_sandboxes()  # the tool calls' sandboxes this worker started (no exit handler runs)
        os._exit(code)
