"""A training stage on several nodes, as the stage task sees it: put the launch request and inputs in the stage's
MLflow run, have the configured launcher start one node agent per node, wait for every node's report (or the
job's end), and turn them into the stage's result or one error that names the node and rank that failed first.
The nodes share nothing but the MLflow tracking server.

Must not import: Prefect (the stage task wraps this; a Prefect cancel reaches ``cancel`` through the wait).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.errors import UserError
from tasks.layout import ADAPTER
from tasks.tracking import RUN_ID_TAG
from tasks.training.launch import TrainingProcessError, allreduce_metrics, reported_error
from tasks.training.ledger import LEDGER_DIR
from tasks.training.nodes.exchange import (
    RESULT,
    StageArtifacts,
    heartbeat_tag,
    node_folder,
)
from tasks.training.nodes.launchers import LocalNodes, ManualNodes, NodeJob, agent_command
from tasks.training.nodes.shipping import send_request
from tasks.training.remote_checkpoints import clear, resume_source, store_for
from tasks.training.trainer import TrainResult

logger = logging.getLogger(__name__)

POLL_S = 2.0
GRACE_S = 30.0  # after the launcher says the job ended, how long reports may still be on their way
FAILURE_GRACE_S = 20.0  # after a node reported a failure, how long the others' reports may still be on their way


class NodesNeedServer(UserError, ValueError):
    """Several nodes with a tracking store that only this machine sees."""


def store_served_to_nodes(config: PipelineConfig, tracking_uri: str) -> bool:
    """Whether ``grpoflow run`` serves the store to the nodes itself: local nodes (on this machine) and a local
    SQLite store, which an MLflow server the run starts opens to them.

    >>> two = PipelineConfig.model_validate({"orchestration": {"nodes": 2}})
    >>> store_served_to_nodes(two, "sqlite:///x.db"), store_served_to_nodes(two, "http://mlflow:5000")
    (True, False)
    """
    orchestration = config.orchestration
    local = orchestration.launcher == "local" and not orchestration.local_network_namespaces  # nodes on loopback
    return orchestration.nodes > 1 and local and tracking_uri.startswith("sqlite:")


def check_shared_store(config: PipelineConfig, tracking_uri: str) -> None:
    """The nodes meet only in MLflow: a store other machines reach (an ``http(s)://`` tracking server, and not on
    loopback where the launcher puts the nodes on other hosts: Slurm, except its ``one_host`` test cluster, and
    Kubeflow).

    >>> check_shared_store(PipelineConfig(), "sqlite:///x.db")  # one node: any store
    >>> two = PipelineConfig.model_validate({"orchestration": {"nodes": 2}})
    >>> check_shared_store(two, "sqlite:///x.db")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tasks.training.nodes.stage.NodesNeedServer: orchestration.nodes is 2: the nodes share nothing but the MLflow ...
    >>> slurm = PipelineConfig.model_validate({"orchestration": {"nodes": 2, "launcher": "slurm"}})
    >>> check_shared_store(slurm, "http://127.0.0.1:5000")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tasks.training.nodes.stage.NodesNeedServer: orchestration.launcher slurm runs the nodes on other hosts (or ...
    """
    from urllib.parse import urlparse

    from reward_fns.judges.settings import is_loopback

    orchestration = config.orchestration
    if orchestration.nodes <= 1:
        return
    if not tracking_uri.startswith(("http://", "https://", "databricks")):
        served = " (`grpoflow run` serves a local SQLite store to local nodes itself)"
        served = served if orchestration.launcher == "local" else ""
        raise NodesNeedServer(
            f"orchestration.nodes is {orchestration.nodes}: the nodes share nothing but the MLflow tracking "
            f"server, and {tracking_uri} is a store only this machine sees; set tracking.tracking_uri to a server "
            f"every node reaches (e.g. `mlflow server --serve-artifacts`){served}"
        )
    elsewhere = (
        orchestration.launcher == "kubeflow"
        or (orchestration.launcher == "slurm" and not orchestration.slurm.one_host)
        or bool(orchestration.local_network_namespaces)
    )
    host = urlparse(tracking_uri).hostname or ""
    if elsewhere and (is_loopback(host) or host == "localhost"):
        raise NodesNeedServer(
            f"orchestration.launcher {orchestration.launcher} runs the nodes on other hosts (or networks), "
            f"and {tracking_uri} answers only on this one: set tracking.tracking_uri to an address the nodes reach"
        )


def job_for(config: PipelineConfig, commands: list[list[str]], launch_dir: Path, name: str, uri: str) -> NodeJob:
    """The configured launcher's job for these agents."""
    launcher = config.orchestration.launcher
    if launcher == "local":
        handover = config.grpo.generation.vllm_adapter_dir  # written by the nodes, read by a vLLM server
        shared = (Path(handover),) if handover else ()
        shared += artifact_folders(uri, commands[0][commands[0].index("--stage-run") + 1])
        return LocalNodes(
            commands,
            launch_dir,
            processes_per_node=config.training_processes(),
            shared=shared,
            network_namespaces=tuple(config.orchestration.local_network_namespaces),
        )
    if launcher == "manual":
        return ManualNodes(commands, launch_dir, tuple(config.orchestration.env))
    run_id, sealed = (commands[0][commands[0].index(flag) + 1] for flag in ("--stage-run", "--manifest"))
    generic = agent_command(uri, run_id, sealed)  # the node rank from the job's settings
    if launcher == "slurm":
        from tasks.training.nodes.slurm import SlurmJob, job_name

        python = config.orchestration.node_python or generic[0]  # the nodes' interpreter, not only this machine's
        return SlurmJob(config, [python, *generic[1:]], launch_dir, job_name(name, launch_dir.parent.name))
    from tasks.training.nodes.kubeflow import KubeflowJob, resource_name

    return KubeflowJob(config, generic, launch_dir, resource_name(name, launch_dir.parent.name), uri)


def artifact_folders(tracking_uri: str, run_id: str) -> tuple[Path, ...]:
    """The folder local nodes must write where the stage run's artifacts live on this disk (a server over a local
    store hands out ``file://`` locations, as ``mlflow ui`` does): the experiment's, which holds the pipeline run's
    checkpoints too. None where the server stores the artifacts itself.

    >>> artifact_folders("http://127.0.0.1:9", "")  # nothing asked where the URI is no local store's server
    ()
    """
    from urllib.parse import unquote, urlparse

    from tasks.tracking import client_for

    if not run_id:
        return ()
    location = urlparse(client_for(tracking_uri).get_run(run_id).info.artifact_uri)
    if location.scheme != "file":
        return ()
    return (Path(unquote(location.path)).parents[1],)  # <experiment>/<run>/artifacts


def attempt_store(stage_run: Any, store: dict[str, Any]) -> dict[str, Any]:
    """The store to resume from: the newest attempt at this pipeline run holding a complete checkpoint
    (``resume_source``)."""
    run = stage_run.client.get_run(stage_run.run_id)
    return resume_source(stage_run.client, run.info.experiment_id, run.data.tags[RUN_ID_TAG], store)


def node_reports(
    artifacts: StageArtifacts, nodes: int, known: dict[int, dict[str, Any]] | None = None
) -> dict[int, dict[str, Any]]:
    """The exits the nodes have reported so far; those in ``known`` are not fetched again."""
    reports = dict(known or {})
    for node in range(nodes):
        if node not in reports and f"{node_folder(node)}/exit.json" in artifacts.names(node_folder(node)):
            reports[node] = artifacts.fetch_json(f"{node_folder(node)}/exit.json")
    return reports


def silent_nodes(
    tags: dict[str, str], nodes: int, reported: set[int], now: float, timeout_s: float
) -> dict[int, float]:
    """The nodes that beat once and then fell silent for more than ``timeout_s`` without reporting, and for how long
    (a node not yet started, e.g. queued, has no beat and is not judged).

    >>> silent_nodes({"grpoflow.node.0.beat": "100.0", "grpoflow.node.1.beat": "70.0"}, 2, set(), 110.0, 30.0)
    {1: 40.0}
    """
    silent = {}
    for node in range(nodes):
        beat = tags.get(heartbeat_tag(node))
        if node not in reported and beat is not None and now - float(beat) > timeout_s:
            silent[node] = round(now - float(beat), 1)
    return silent


def node_failed(exit_report: dict[str, Any]) -> bool:
    """Whether a node's exit report is a failure that ends the stage: a non-zero exit, unless every rank of the
    node had marked its work done (past the last collective, the result written): an abort at exit, which the
    other nodes finish through.

    >>> node_failed({"returncode": 1}), node_failed({"returncode": -6, "ranks_finished": True})
    (True, False)
    """
    return exit_report["returncode"] != 0 and not exit_report.get("ranks_finished", False)


def wait_for_nodes(
    job: NodeJob,
    artifacts: StageArtifacts,
    nodes: int,
    timeout_s: float | None,
    failure_grace_s: float = FAILURE_GRACE_S,
    heartbeat_timeout_s: float | None = None,
) -> dict[int, Any]:
    """Poll until every node reported, a node reported a failure (then the others get ``failure_grace_s`` to
    report: one may be hung in a collective with the failed node, waiting for its timeout), or the job ended (and a
    grace period passed); returns the reports. Each node's report is fetched once. A node whose heartbeat stopped
    for ``heartbeat_timeout_s`` (its host or link gone, its sockets left open) ends the wait with an error naming
    it: its peers would wait in a collective until the process group's timeout."""
    started, ended_at, failed_at = time.monotonic(), None, None
    reports: dict[int, Any] = {}
    while True:
        reports = node_reports(artifacts, nodes, reports)
        if len(reports) == nodes:
            return reports
        if heartbeat_timeout_s is not None and failed_at is None:
            tags = artifacts.client.get_run(artifacts.run_id).data.tags
            silent = silent_nodes(tags, nodes, set(reports), time.time(), heartbeat_timeout_s)
            if silent:
                node, quiet = next(iter(silent.items()))
                raise TrainingProcessError(
                    f"node {node} went silent: no heartbeat for {quiet:.0f} s (orchestration.node_heartbeat_timeout_s "
                    f"{heartbeat_timeout_s:.0f}; its host or its link is gone) and no report; every node was stopped "
                    f"({job.description}); `grpoflow run --resume` restarts every node from the newest complete "
                    "checkpoint"
                )
        failed = sorted(n for n, report in reports.items() if node_failed(report))
        if failed_at is None and failed:
            failed_at = time.monotonic()
            logger.error("node %s reported a failure: the stage ends (the others are stopped)", failed[0])
        if failed_at is not None and time.monotonic() - failed_at > failure_grace_s:
            return reports
        state = job.state()
        if state == "ended":
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > (0 if isinstance(job, LocalNodes) else GRACE_S):
                return node_reports(artifacts, nodes, reports)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise TrainingProcessError(
                f"the nodes did not finish within orchestration.node_wait_timeout_s ({timeout_s:.0f} s); "
                f"{len(reports)} of {nodes} reported ({job.description})"
            )
        time.sleep(0.2 if state == "ended" or failed_at is not None else POLL_S)


def rank_reports(artifacts: StageArtifacts, nodes: int) -> list[dict[str, Any]]:
    """Every error a rank (or an agent) reported, first first."""
    reports = []
    for node in range(nodes):
        for name in artifacts.names(f"{node_folder(node)}/errors"):
            reports.append({"node": node, **artifacts.fetch_json(name)})
    return sorted(reports, key=lambda report: report["time"])


def nodes_error(
    stage: str,
    job: NodeJob,
    artifacts: StageArtifacts,
    nodes: int,
    exits: dict[int, Any],
    reports: list[dict[str, Any]] | None = None,
    ended_before_stop: dict[int, str] | None = None,
) -> Exception:
    """One error for a failed group: a node that vanished without a report and that the launcher saw end on its own
    (the others stopped because of it); else the first error a rank reported, keeping its type (a gate stop on node
    1 is still a gate stop) and naming the nodes stopped with it (a node still running, hung behind it); else a node
    that reported a failure with no rank's report (a rank that aborted); else a node that vanished; else the nodes'
    exit codes. ``reports``: the ranks' reports, when already read; ``ended_before_stop``: the launcher's ends as they
    were when the stage stopped the remaining nodes (an end the stage caused is not a cause)."""
    logs = f"MLflow run {artifacts.run_id} artifacts launch/nodes/"
    resume = "`grpoflow run --resume` restarts every node from the newest complete checkpoint"
    vanished = [node for node in range(nodes) if node not in exits]
    reports = rank_reports(artifacts, nodes) if reports is None else reports
    failed = sorted(node for node, report in exits.items() if report["returncode"] != 0)
    ends = job.ends() if vanished else {}
    if ended_before_stop is not None:
        ends = {node: how for node, how in ends.items() if node in ended_before_stop}
    # A node the launcher saw end (killed, crashed) is the cause, whatever the others then reported about it (a peer
    # closing the connection); one still running without a report is hung behind a node that reported a failure.
    if vanished and (any(n in ends for n in vanished) or not failed):
        how = "; ".join(f"node {n}: {ends.get(n, 'no report')}" for n in vanished)
        others = ", ".join(f"node {n}: exit {report['returncode']}" for n, report in sorted(exits.items()))
        return TrainingProcessError(
            f"{stage}: node {vanished[0]} ended without reporting ({how}); the other nodes stopped with it "
            f"({others or 'none reported'}); logs: {logs}; {resume}"
        )
    stopped = f"node {', '.join(map(str, vanished))} stopped with it" if vanished else "every node was stopped"
    if not reports and failed:
        return TrainingProcessError(
            f"{stage}: node {failed[0]} failed (exit {exits[failed[0]]['returncode']}) and no rank reported an error "
            f"(a rank that aborted: see node {failed[0]}'s log.txt); {stopped}; logs: {logs}; {resume}"
        )
    if not reports:
        codes = ", ".join(f"node {n}: {e['returncode']}" for n, e in sorted(exits.items()))
        return TrainingProcessError(f"{stage}: the nodes exited ({codes}) and no rank reported an error; logs: {logs}")
    first = reports[0]
    where = f"node {first['node']}" + (f" rank {first['rank']}" if first.get("rank") is not None else "")
    return reported_error(first, f"{stage} {where}: {first['message']}", f"{stopped}; logs: {logs}")


def train_on_nodes(
    stage: str,
    config: PipelineConfig,
    stage_run: Any,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None = None,
    keep_ids: set[str] | None = None,
    checkpoint_store: dict[str, Any] | None = None,
) -> TrainResult:
    """Run ``stage`` on ``orchestration.nodes`` nodes and return rank 0's result, its adapter (and rollout ledger)
    downloaded into the stage's folder. Checkpoints go to the pipeline run's store, every node's part of each."""
    uri, nodes = stage_run.tracking_uri, config.orchestration.nodes
    check_shared_store(config, uri)
    artifacts = StageArtifacts(uri, stage_run.run_id)
    parent = stage_run.client.get_run(stage_run.run_id).data.tags["mlflow.parentRunId"]
    store = checkpoint_store or {
        "remote_checkpoints": config.orchestration.remote_checkpoints,
        "tracking_uri": uri,
        "parent_run_id": parent,
        "run_id": Path(stage_run.dir).parent.name,
    }
    store = {**store, "stage": stage, "nodes": nodes}
    restore = attempt_store(stage_run, store)
    sealed = send_request(
        artifacts, stage, config, train_path, base_model_dir, sft_adapter_dir, keep_ids, store, restore
    )
    stage_run.set_tags({"nodes": nodes, "launcher": config.orchestration.launcher, "launch_manifest": sealed})
    commands = [agent_command(uri, stage_run.run_id, sealed, node) for node in range(nodes)]
    launch_dir = Path(stage_run.dir) / "launch"
    job = job_for(config, commands, launch_dir, Path(stage_run.dir).parent.name, uri)
    started = time.perf_counter()
    processes = config.training_processes()
    logger.info("%s on %s, %d process%s each", stage, job.description, processes, "es" if processes > 1 else "")
    job.start()
    try:
        exits = wait_for_nodes(
            job,
            artifacts,
            nodes,
            config.orchestration.node_wait_timeout_s,
            heartbeat_timeout_s=config.orchestration.node_heartbeat_timeout_s,
        )
    except BaseException:
        job.cancel()  # a Prefect cancel, a timeout, Ctrl-C: the nodes must not train on alone
        raise
    ended_before_stop = None
    if job.state() != "ended" and any(node_failed(e) for e in exits.values()):
        ended_before_stop = job.ends()  # what ended on its own, before the stage stopped the rest
        job.cancel()
    stage_run.log_metrics({f"node_{n}_seconds": e["seconds"] for n, e in exits.items()})
    found = f"{RESULT}/result.json" in artifacts.names(RESULT)
    failed = [node for node, exit_report in exits.items() if exit_report["returncode"] != 0]
    reports = rank_reports(artifacts, nodes) if failed or not found or len(exits) < nodes else []
    if not found or len(exits) < nodes or (failed and reports):
        raise nodes_error(stage, job, artifacts, nodes, exits, reports, ended_before_stop)
    if failed:
        # Rank 0 wrote the result after the last collective: a node that failed after that (at exit) must not
        # throw the whole adapter away. Said, not hidden.
        logger.warning("%s: node %s exited with an error after the stage finished; the result is whole", stage, failed)
    result = artifacts.fetch_json(f"{RESULT}/result.json")
    stage_run.log_metrics(allreduce_metrics(result))
    stage_dir = Path(stage_run.dir)
    for name in (ADAPTER, LEDGER_DIR):
        if f"{RESULT}/{name}" in artifacts.names(RESULT):
            shutil.rmtree(stage_dir / name, ignore_errors=True)
            with tempfile.TemporaryDirectory(dir=stage_dir) as scratch:
                artifacts.fetch(f"{RESULT}/{name}", Path(scratch)).rename(stage_dir / name)
    for done_with in {json.dumps(store, sort_keys=True), json.dumps(restore, sort_keys=True)}:
        clear(store_for(json.loads(done_with)))  # the adapter is here: the nodes' checkpoints are done with
    logger.info("%s on %d nodes: %d steps in %.0f s", stage, nodes, result["steps"], time.perf_counter() - started)
    return TrainResult(
        stage_dir / ADAPTER,
        result["steps"],
        result["seconds"],
        result["history"],
        result.get("stop"),
        generated_by=result.get("generated_by"),
        selection=result.get("selection"),
        holdout_seconds=result.get("holdout_seconds", 0.0),
    )
