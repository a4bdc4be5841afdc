"""Evaluation's jobs in two processes: dependencies kept, the worker's results, log lines, progress and failures
brought back, a dead worker's job done here, and the evaluation table the same to the bit as in one process."""

import json
import logging
import os
import time

import pytest

from tasks.evaluate import ModelSpec, run_evaluate
from tasks.evaluation import Job, run_jobs
from tasks.evaluation.parallel import JobFailed

HERE = os.getpid()


def _pause() -> None:
    """A job's start: long in this process, so that the worker surely takes the other job meanwhile."""
    time.sleep(1.5 if os.getpid() == HERE else 0.1)


def _timed(name: str):
    def run(report):
        started = time.time()
        _pause()
        report(1)
        return {"name": name, "pid": os.getpid(), "start": started, "end": time.time()}

    return run


def test_two_processes_share_the_jobs_and_keep_their_order() -> None:
    jobs = [Job(name, _timed(name)) for name in "abcd"] + [Job("e", _timed("e"), after=("a", "b", "c", "d"))]
    units = []
    results = run_jobs(jobs, processes=2, report=units.append)
    assert sorted(results) == list("abcde") and all(results[n]["name"] == n for n in results)
    pids = {r["pid"] for r in results.values()}
    assert HERE in pids and len(pids) == 2  # this process and the worker both took jobs
    assert results["e"]["start"] >= max(results[n]["end"] for n in "abcd")  # after its dependencies
    assert sum(units) == 5  # the worker's progress came back too


def test_a_job_that_fails_in_the_worker_raises_here_with_its_traceback() -> None:
    def fails_in_worker(report):
        _pause()
        if os.getpid() != HERE:
            raise ValueError("boom in the worker")
        return "here"

    with pytest.raises(JobFailed, match="boom in the worker"):
        run_jobs([Job("x", fails_in_worker), Job("y", fails_in_worker)], processes=2)


def test_a_job_that_fails_here_raises_as_itself() -> None:
    def fails_here(report):
        _pause()
        if os.getpid() == HERE:
            raise KeyError("here")
        return "worker"

    with pytest.raises(KeyError):
        run_jobs([Job("x", fails_here), Job("y", fails_here)], processes=2)


def test_a_dead_worker_leaves_its_job_to_this_process(caplog) -> None:
    def dies_in_worker(report):
        _pause()
        if os.getpid() != HERE:
            os._exit(3)
        return os.getpid()

    with caplog.at_level(logging.WARNING, logger="tasks.evaluation.parallel"):
        results = run_jobs([Job("x", dies_in_worker), Job("y", dies_in_worker)], processes=2)
    assert results == {"x": HERE, "y": HERE}
    assert "forked worker stopped" in caplog.text and "exit code 3" in caplog.text


def test_the_workers_log_lines_arrive_here(caplog) -> None:
    def logs(report):
        _pause()
        logging.getLogger("tasks.evaluate").info("job ran in %s", "worker" if os.getpid() != HERE else "parent")

    with caplog.at_level(logging.INFO, logger="tasks.evaluate"):
        run_jobs([Job("x", logs), Job("y", logs)], processes=2)
    assert {"job ran in worker", "job ran in parent"} <= {r.getMessage() for r in caplog.records}


@pytest.mark.parametrize("processes", [1, 2])
def test_a_failing_job_raises_in_one_process_or_two(processes) -> None:
    def fails(report):
        raise KeyError("no such row")

    with pytest.raises((KeyError, JobFailed), match="no such row"):
        run_jobs([Job("x", fails), Job("y", _timed("y"))], processes=processes)


def test_unknown_dependencies_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        run_jobs([Job("x", _timed("x"), after=("nope",))])


def _evaluated(config, split, models, folder, processes: int) -> str:
    settings = config.evaluation.model_copy(update={"cache": False, "processes": processes})
    result = run_evaluate(config.model_copy(update={"evaluation": settings}), split.holdout_path, models, folder)
    everything = {
        name: [s.per_prompt_pass1, s.per_prompt_greedy, s.pass_at_k, s.samples]
        + [s.general.doc_nll, s.general.doc_kl, s.general.qa_correct]
        for name, s in result.scores.items()
    }
    table = result.to_json()
    for model in table["models"].values():
        model.pop("tokens_per_second")  # a speed, not a result
    return json.dumps([table, everything], sort_keys=True)


def test_two_processes_give_one_process_numbers(tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path):
    models = {
        "base": ModelSpec("base", tiny_model_dir),
        "sft": ModelSpec("sft", tiny_model_dir, tiny_adapter),
        "candidate": ModelSpec("grpo", tiny_model_dir, tiny_adapter),
    }
    one = _evaluated(tiny_config, tiny_split, models, tmp_path / "one", processes=1)
    two = _evaluated(tiny_config, tiny_split, models, tmp_path / "two", processes=2)
    assert one == two
    measured = json.loads(one)[1]
    assert measured["grpo"][5] and measured["sft"][5]  # the adapters' KL against the base (from the other process)
