"""The node agent: one entry point that, on any machine of a multi-node training stage, fetches the stage's launch
request and inputs from the stage's MLflow run, restores the newest complete checkpoint, starts this node's
``accelerate launch`` (torch.distributed, c10d rendezvous at node 0), and reports back through MLflow: its log,
its exit, its ranks' errors and, from the node that held rank 0, the result and the adapter.

``python -m tasks.training.nodes.agent --tracking-uri URI --stage-run RUN_ID --manifest DIGEST [--node-rank K]``
(or ``grpoflow node-agent``); the node rank defaults to Slurm's ``SLURM_PROCID``, Kubeflow's ``PET_NODE_RANK`` or
``GRPOFLOW_NODE_RANK``. ``DIGEST`` is the stage's sealed manifest's: every file fetched is checked against it
before anything is read or run (``VerifiedInputs``).
Must not import: Prefect, a stage (the ranks run ``tasks.launch`` in their own processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.errors import GrpoflowError, InfrastructureError
from tasks.layout import ADAPTER, CHECKPOINTS
from tasks.training.launch import (
    LAUNCH_DIR,
    LaunchRequest,
    NodePlacement,
    accelerate_command,
    clear_stale_reports,
    ranks_done,
    run_forwarding_log,
)
from tasks.training.ledger import LEDGER_DIR
from tasks.training.nodes.exchange import (
    HEARTBEAT_S,
    INPUTS,
    MANIFEST,
    REQUEST,
    RESULT,
    Manifest,
    NodeInputError,
    NodeInputTampered,
    ShippedInputChanged,
    StageArtifacts,
    heartbeat_tag,
    model_digest,
    node_folder,
)
from tasks.training.nodes.network import communication_environment, local_address_towards
from tasks.training.remote_checkpoints import restore_newest, store_for
from tasks.training.trainer import resumable_checkpoint

logger = logging.getLogger("grpoflow.node")


class VerifiedInputs:
    """The stage's artifacts as a node may use them: the manifest checked against the digest the agent was given,
    then every fetched file against the manifest."""

    def __init__(self, artifacts: StageArtifacts, manifest_digest: str, node: int) -> None:
        self.artifacts, self.node = artifacts, node
        try:
            self.manifest = Manifest.from_bytes(artifacts.fetch_bytes(MANIFEST), manifest_digest)
            data = artifacts.fetch_bytes(REQUEST)
            self.manifest.check_request(data)
        except ShippedInputChanged as exc:
            raise NodeInputTampered(f"node {node}: {exc}; stopped before anything was read or run") from None
        self.request = json.loads(data)

    def fetch(self, name: str, destination: Path) -> Path:
        local = self.artifacts.fetch(name, destination)
        try:
            return self.manifest.check(local, name)
        except ShippedInputChanged as exc:
            raise NodeInputTampered(f"node {self.node}: {exc}; stopped before anything was run") from None


def node_rank_from_environment(environ: dict[str, str] | None = None) -> int | None:
    """This node's rank as its launcher says it: ``GRPOFLOW_NODE_RANK``, Slurm's ``SLURM_PROCID`` or Kubeflow's
    (torchrun's) ``PET_NODE_RANK``.

    >>> node_rank_from_environment({"SLURM_PROCID": "1"}), node_rank_from_environment({})
    (1, None)
    """
    environ = os.environ if environ is None else environ
    for name in ("GRPOFLOW_NODE_RANK", "SLURM_PROCID", "PET_NODE_RANK"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def rendezvous_from_environment(request: dict[str, Any], environ: dict[str, str] | None = None) -> tuple[str, int]:
    """Node 0's address and port: ``GRPOFLOW_RENDEZVOUS_HOST`` (a Slurm job's first host), Kubeflow's
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, else the request's (``orchestration.rendezvous_host``/``_port``).

    >>> rendezvous_from_environment({"host": "127.0.0.1", "port": 29410}, {"PET_MASTER_ADDR": "job-node-0-0"})
    ('job-node-0-0', 29410)
    """
    environ = os.environ if environ is None else environ
    host = environ.get("GRPOFLOW_RENDEZVOUS_HOST") or environ.get("PET_MASTER_ADDR") or request["host"]
    port = environ.get("PET_MASTER_PORT") or request["port"]
    return host, int(port)


def base_model_for(request: dict[str, Any], artifacts: VerifiedInputs, inputs: Path, node: int) -> Path:
    """The base model on this node: the copy the stage shipped, else this node's own resolution of the source,
    checked to hold the same bytes as the stage's (a model built or converted here must not differ silently)."""
    model = request["model"]
    if model.get("shipped"):
        return artifacts.fetch(f"{INPUTS}/base-model", inputs)
    from tasks.models import resolve_model_source

    try:
        folder = resolve_model_source(model["source"], model.get("revision"))
    except GrpoflowError as exc:
        raise NodeInputError(f"node {node}: cannot resolve the base model {model['source']!r}: {exc}") from exc
    here = model_digest(folder)
    if here != model["digest"]:
        raise NodeInputError(
            f"node {node}: the base model {model['source']!r} resolves here to other bytes than the stage's "
            f"(digest {here}, expected {model['digest']}; folder {folder}); give every node the same files, or use "
            "a local folder source, which the stage ships"
        )
    return folder


def prepare_node(
    request: dict[str, Any], artifacts: VerifiedInputs, node: int, node_dir: Path
) -> tuple[PipelineConfig, Path]:
    """Fetch the inputs (each checked against the stage's manifest), restore the newest complete checkpoint, and
    write this node's local launch request; returns the config and the request's path."""
    inputs = node_dir / "inputs"
    train_path = artifacts.fetch(f"{INPUTS}/{request['train_file']}", inputs)
    if request.get("holdout_file"):  # beside the train file, where GRPO's in-training evaluation reads it
        fetched = artifacts.fetch(f"{INPUTS}/{request['holdout_file']}", inputs)
        if fetched != train_path.with_name(request["holdout_file"]):
            fetched.replace(train_path.with_name(request["holdout_file"]))
    sft_adapter = artifacts.fetch(f"{INPUTS}/sft-adapter", inputs) if request.get("sft_adapter") else None
    base_model = base_model_for(request, artifacts, inputs, node)
    config = request["config"]
    for index in request.get("reward_modules", []):  # shipped: this machine does not have the stage's folders
        config["rewards"][index]["path"] = str(artifacts.fetch(f"{INPUTS}/rewards/{index}", inputs / "rewards"))
    for index in request.get("tool_modules", []):  # a tool's module, from the stage's tools.use[].path folder
        config["tools"]["use"][index]["path"] = str(artifacts.fetch(f"{INPUTS}/tools/{index}", inputs / "tools"))
    for index in request.get("reward_models", []):  # a reward model's local folder, shipped the same way
        folder = artifacts.fetch(f"{INPUTS}/reward-models/{index}", inputs / "reward-models")
        config["rewards"][index]["args"]["model"] = str(folder)
    if config["orchestration"].get("accelerate_config"):
        accelerate_file = artifacts.fetch(f"{INPUTS}/accelerate.yaml", inputs)
        config["orchestration"]["accelerate_config"] = str(accelerate_file)
    stage_dir = node_dir / request["stage"]
    store = {**request["checkpoint_store"], "node": node}
    restore_from = {**(request.get("restore_store") or store), "node": node}
    restore_newest(store_for(restore_from), stage_dir / CHECKPOINTS)  # logs "restored checkpoint-N from …"
    resumable_checkpoint(stage_dir / CHECKPOINTS)
    launch_dir = stage_dir / LAUNCH_DIR
    launch_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_reports(launch_dir)  # a persistent work folder: a previous attempt's reports are not this one's
    local = LaunchRequest(
        stage=request["stage"],
        config=config,
        train_path=str(train_path),
        base_model_dir=str(base_model),
        stage_dir=str(stage_dir),
        tracking_uri=artifacts.artifacts.tracking_uri,
        stage_run_id=artifacts.artifacts.run_id,
        sft_adapter_dir=str(sft_adapter) if sft_adapter else None,
        keep_ids=request.get("keep_ids"),
        checkpoint_store=store,
    )
    request_path = launch_dir / "request.json"
    request_path.write_text(json.dumps(asdict(local)))
    return PipelineConfig.model_validate(config), request_path


def report(artifacts: StageArtifacts, node: int, launch_dir: Path, exit_report: dict[str, Any]) -> None:
    """Send this node's reports up: its ranks' errors, the result and adapter when rank 0 ran here, its log, and
    last its exit (the stage counts a node as done once its exit is up)."""
    folder = node_folder(node)
    for error in sorted(launch_dir.glob("rank-*.error.json")):
        artifacts.put(error, f"{folder}/errors/{error.name}")
    result_file = launch_dir / "result.json"
    if result_file.is_file():
        result = json.loads(result_file.read_text())
        adapter = Path(result["adapter_dir"])
        artifacts.put(adapter, f"{RESULT}/{ADAPTER}")
        if (adapter.parent / LEDGER_DIR).is_dir():
            artifacts.put(adapter.parent / LEDGER_DIR, f"{RESULT}/{LEDGER_DIR}")
        artifacts.put(result_file, f"{RESULT}/result.json")  # after the adapter: a result found is whole
    if (launch_dir / "ranks.log").is_file():
        artifacts.put(launch_dir / "ranks.log", f"{folder}/log.txt")
    artifacts.put_json(exit_report, f"{folder}/exit.json")


def run_agent(
    tracking_uri: str,
    stage_run_id: str,
    node: int,
    workdir: Path,
    manifest_digest: str,
    rendezvous_host: str | None = None,
    local_addr: str | None = None,
) -> int:
    """Run this node's part of the stage; returns the launcher's exit code (the agent's own failure: its exit
    code as a grpoflow error, after reporting it). ``manifest_digest`` (from the launcher, not from MLflow)
    decides which of the run's files this node trusts."""
    artifacts = StageArtifacts(tracking_uri, stage_run_id)
    started = time.time()
    heartbeat = Heartbeat(artifacts, node)
    heartbeat.start()
    node_dir = workdir / f"node-{node}"
    launch_dir = node_dir / "launch-agent"
    launch_dir.mkdir(parents=True, exist_ok=True)
    returncode, ranks_finished = 1, False
    try:
        verified = VerifiedInputs(artifacts, manifest_digest, node)
        request = verified.request
        config, request_path = prepare_node(request, verified, node, node_dir)
        launch_dir = request_path.parent
        host, port = rendezvous_from_environment(request)
        placement = NodePlacement(request["nodes"], node, rendezvous_host or host, port)
        command = accelerate_command(config, request_path, placement=placement)
        env = {"GRPOFLOW_NODE_RANK": str(node), **node_network(placement.host, config, local_addr)}
        missing = [name for name in config.orchestration.env if not os.environ.get(name)]
        if missing:
            raise NodeInputError(
                f"node {node}: orchestration.env names {', '.join(missing)}, not set on this node "
                "(set it where the launcher starts the agent: the shell, Slurm's environment, kubeflow.env_secret)"
            )
        logger.info("node %d of %d: %s", node, request["nodes"], " ".join(command[1:]))
        returncode = run_forwarding_log(command, launch_dir / "ranks.log", env, forward=_print_rank_zero)
        # Every rank here past the last collective (its done marker): an exit code that says otherwise came at exit.
        ranks_finished = ranks_done(launch_dir, config.training_processes())
    except Exception as exc:
        returncode = exc.exit_code if isinstance(exc, GrpoflowError) else 1
        agent_error = {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc)[:2000]}
        (launch_dir / "rank-agent.error.json").write_text(
            json.dumps({"rank": None, "node": node, "time": time.time(), **agent_error})
        )
        logger.error("node %d: %s", node, exc)
    ended = time.time()
    exit_report = {
        "node": node,
        "returncode": returncode,
        "seconds": round(ended - started, 1),
        "ended": ended,
        "ranks_finished": ranks_finished,
    }
    heartbeat.stop()
    try:
        report(artifacts, node, launch_dir, exit_report)
    except Exception as exc:  # the stage then sees a node that never reported, and says so
        raise InfrastructureError(f"node {node}: could not report to MLflow ({tracking_uri}): {exc}") from exc
    return returncode


def node_network(rendezvous_host: str, config: PipelineConfig, local_addr: str | None) -> dict[str, str]:
    """The environment that makes this node meet the others where they can reach it: gloo's and NCCL's interface
    and torchrun's own address (``PET_LOCAL_ADDR``), both on the route to node 0, unless given."""
    env = communication_environment(rendezvous_host, config.orchestration.network_interface, dict(os.environ))
    if local_addr is None and "PET_LOCAL_ADDR" not in os.environ:
        with contextlib.suppress(OSError):
            local_addr = local_address_towards(rendezvous_host)
    if local_addr:
        env["PET_LOCAL_ADDR"] = local_addr  # else torchrun takes the hostname's address, often loopback
    if env:
        logger.info("node network: %s", ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return env


class Heartbeat:
    """Every ``HEARTBEAT_S``, this node's time in its tag on the stage run (``grpoflow.node.<k>.beat``): a node
    whose beats stop while it has not reported is gone (its host or its link), which the stage sees without waiting
    for the collectives' timeout."""

    def __init__(self, artifacts: StageArtifacts, node: int) -> None:
        self.artifacts, self.node = artifacts, node
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"node-{node}-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(Exception):  # a store that does not answer now: the stage judges the silence
                self.artifacts.client.set_tag(self.artifacts.run_id, heartbeat_tag(self.node), f"{time.time():.1f}")
            self.stopped.wait(HEARTBEAT_S)


def _print_rank_zero(line: str) -> None:
    if line.startswith("[rank 0] "):
        print(line, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow node-agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", required=True, help="The MLflow tracking server every node reaches.")
    parser.add_argument("--stage-run", required=True, help="The stage's MLflow run id (its launch request).")
    parser.add_argument(
        "--manifest", required=True, help="The digest of the stage's sealed manifest (the launcher writes it)."
    )
    parser.add_argument("--node-rank", type=int, default=None, help="Default: from Slurm's or Kubeflow's settings.")
    parser.add_argument("--rendezvous-host", default=None, help="Node 0's address (default: the request's).")
    parser.add_argument("--local-addr", default=None, help="This node's own address (torchrun's --local-addr).")
    parser.add_argument("--workdir", type=Path, default=None, help="Node-local scratch (default: a temp folder).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[node] %(message)s", stream=sys.stdout)
    node = args.node_rank if args.node_rank is not None else node_rank_from_environment()
    if node is None:
        print(f"{parser.prog}: no --node-rank, and no SLURM_PROCID or PET_NODE_RANK to take it from", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"grpoflow-node-{node}-"))
    try:
        return run_agent(
            args.tracking_uri, args.stage_run, node, workdir, args.manifest, args.rendezvous_host, args.local_addr
        )
    except GrpoflowError as exc:
        print(f"grpoflow node-agent: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
