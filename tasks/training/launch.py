"""Multi-process training: SFT or GRPO on N processes (``accelerate launch``: torch.distributed, or DeepSpeed from
an accelerate config file), while the flow itself runs once.

The stage task (one process) writes a request file and launches the group; every rank runs the same plain stage
function (``run_sft`` / ``run_grpo``); only rank 0 logs to the stage's MLflow run, saves checkpoints and the
adapter, and writes the result the stage task reads back. A rank that fails writes its error beside the request
and exits; the launcher (torch's elastic agent) then ends every other rank, so the group never hangs on a dead
peer, and the stage raises the first rank's error.

Owns: the launch command and the request/result/error/exit files. The ranks' entry point, which runs the stage
functions, is ``tasks/launch.py`` (``python -m tasks.launch``): a stage module, so nothing here imports a stage.
Must not import: Prefect (the ranks run no flow).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.errors import InfrastructureError
from tasks.layout import CHECKPOINTS
from tasks.training.threads import rank_threads
from tasks.training.trainer import TrainResult, resumable_checkpoint

# What rank 0 measured of its process group after training (tasks/launch.py), logged on the stage run.
ALLREDUCE_METRICS = ("allreduce_ms", "allreduce_bytes")

logger = logging.getLogger(__name__)


def allreduce_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The all-reduce figures rank 0 put in its result, to log on the stage run (none on one process).

    >>> allreduce_metrics({"steps": 2, "allreduce_ms": 0.9, "allreduce_bytes": 139264})
    {'allreduce_ms': 0.9, 'allreduce_bytes': 139264}
    >>> allreduce_metrics({"steps": 2})
    {}
    """
    return {key: result[key] for key in ALLREDUCE_METRICS if result.get(key) is not None}


LAUNCH_DIR = "launch"  # under the stage's folder: request.json, result.json, rank-N.error.json, rank-N.done, ranks.log


def rank_done_file(launch_dir: Path, rank: int) -> Path:
    """Written by a rank once every rank is past its last collective and rank 0 wrote the result (tasks/launch.py):
    the rank's work is done, whatever its exit code then says (an abort at interpreter exit).

    >>> rank_done_file(Path("launch"), 3).name
    'rank-3.done'
    """
    return launch_dir / f"rank-{rank}.done"


def ranks_done(launch_dir: Path, processes: int) -> bool:
    """Whether ``processes`` ranks in ``launch_dir`` marked their work done (a node's own ranks: its markers only).

    >>> ranks_done(Path("/nonexistent"), 2)
    False
    """
    return len(list(launch_dir.glob("rank-*.done"))) >= processes


def clear_stale_reports(launch_dir: Path) -> None:
    """Remove a previous attempt's rank errors, done markers and result from ``launch_dir`` (a resume in the same
    folder must not report them as this attempt's)."""
    for stale in [*launch_dir.glob("rank-*.error.json"), *launch_dir.glob("rank-*.done"), launch_dir / "result.json"]:
        stale.unlink(missing_ok=True)


class TrainingProcessError(InfrastructureError, RuntimeError):
    """A rank of a multi-process training stage died (its error is in the message)."""


@dataclass
class LaunchRequest:
    """What every rank needs to run one training stage (JSON on disk: ranks are other processes)."""

    stage: str  # "sft" | "grpo"
    config: dict[str, Any]
    train_path: str
    base_model_dir: str
    stage_dir: str
    tracking_uri: str
    stage_run_id: str
    sft_adapter_dir: str | None = None
    keep_ids: list[str] | None = None
    checkpoint_store: dict[str, Any] | None = None  # tasks.training.remote_checkpoints.store_for's spec (rank 0 copies)


@dataclass(frozen=True)
class NodePlacement:
    """Where one node's launcher sits in a group of machines: ``nodes`` machines meeting at node 0's
    ``host:port`` (torch's c10d rendezvous store), this one being ``node_rank``."""

    nodes: int
    node_rank: int
    host: str
    port: int


def accelerate_command(
    config: PipelineConfig, request_path: Path, cuda: bool | None = None, placement: NodePlacement | None = None
) -> list[str]:
    """``accelerate launch`` for the ranks: ``orchestration.num_processes`` wins over the config file's count;
    without CUDA (and without a file) the ranks use torch.distributed's gloo backend on CPU. With a
    ``placement`` (several nodes), ``--num_processes`` is the world size (accelerate divides it by the machines),
    the port is fixed, and node 0 alone hosts the rendezvous store (``is_host``: on one host every node's address
    matches the endpoint, and each would try to host it).

    >>> cfg = PipelineConfig.model_validate({"orchestration": {"num_processes": 2}})
    >>> " ".join(accelerate_command(cfg, Path("r.json"), cuda=False)[3:])
    '--num_processes 2 --main_process_port 0 --multi_gpu --mixed_precision no -m tasks.launch r.json'
    >>> on_two = NodePlacement(nodes=2, node_rank=1, host="10.0.0.1", port=29410)
    >>> " ".join(accelerate_command(cfg, Path("r.json"), cuda=False, placement=on_two)[3:13])
    '--num_processes 4 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29410'
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if placement is None or placement.nodes == 1:
        command += ["--num_processes", str(config.training_processes())]
        command += ["--main_process_port", "0"]  # a free port: two runs on one machine do not collide
    else:
        world = placement.nodes * config.training_processes()
        command += ["--num_processes", str(world), "--num_machines", str(placement.nodes)]
        command += ["--machine_rank", str(placement.node_rank), "--main_process_ip", placement.host]
        command += ["--main_process_port", str(placement.port), "--rdzv_backend", "c10d"]
        command += ["--rdzv_conf", f"is_host={int(placement.node_rank == 0)}"]
    accelerate_file = config.orchestration.accelerate_config
    if accelerate_file:
        command += ["--config_file", str(accelerate_file)]
    else:
        # torchrun-style launch; on CPU, accelerate then picks MULTI_CPU with gloo (the trainers set use_cpu).
        # Not --cpu: that switches accelerate to an mpirun launch.
        command += ["--multi_gpu", "--mixed_precision", "bf16" if cuda else "no"]
    return [*command, "-m", "tasks.launch", str(request_path)]


def train_on_processes(
    stage: str,
    config: PipelineConfig,
    stage_run: Any,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None = None,
    keep_ids: set[str] | None = None,
    checkpoint_store: dict[str, Any] | None = None,
) -> TrainResult:
    """Run ``stage`` ("sft" | "grpo") on ``config.training_processes()`` processes and return rank 0's result.
    ``stage_run`` is the stage's ``tasks.tracking.StageRun`` (rank 0 logs to it); its folder holds the checkpoints."""
    stage_dir = Path(stage_run.dir)
    launch_dir = stage_dir / LAUNCH_DIR
    launch_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_reports(launch_dir)
    resumable_checkpoint(stage_dir / CHECKPOINTS)  # a corrupt checkpoint is set aside once, here, not by N ranks
    request = LaunchRequest(
        stage=stage,
        config=config.model_dump(mode="json"),
        train_path=str(train_path),
        base_model_dir=str(base_model_dir),
        stage_dir=str(stage_dir),
        tracking_uri=stage_run.tracking_uri,
        stage_run_id=stage_run.run_id,
        sft_adapter_dir=str(sft_adapter_dir) if sft_adapter_dir else None,
        keep_ids=sorted(keep_ids) if keep_ids is not None else None,
        checkpoint_store=checkpoint_store,
    )
    request_path = launch_dir / "request.json"
    request_path.write_text(json.dumps(asdict(request)))
    command = accelerate_command(config, request_path)
    processes = config.training_processes()
    logger.info("%s on %d processes: %s", stage, processes, " ".join(command[1:]))
    started = time.perf_counter()
    threads = {"OMP_NUM_THREADS": str(rank_threads(processes))}  # named: never what this process set before
    returncode = run_forwarding_log(command, launch_dir / "ranks.log", env=threads)
    (launch_dir / "exit.json").write_text(json.dumps({"returncode": returncode}))
    finished = (launch_dir / "result.json").is_file() and not list(launch_dir.glob("rank-*.error.json"))
    if returncode != 0 and not finished:
        raise rank_error(launch_dir, stage, returncode)
    if returncode != 0:
        # Rank 0 wrote the result after the last collective, so every rank did its share of the training: a rank
        # that died after that (at exit) must not throw the whole adapter away. Said, not hidden.
        logger.warning(
            "%s: a rank exited with code %d after the stage finished; its result and adapter are whole "
            "and kept (log: %s)",
            stage,
            returncode,
            launch_dir / "ranks.log",
        )
    result = json.loads((launch_dir / "result.json").read_text())
    stage_run.log_metrics(allreduce_metrics(result))
    logger.info(
        "%s on %d processes: %d steps in %.0f s", stage, processes, result["steps"], time.perf_counter() - started
    )
    return TrainResult(
        Path(result["adapter_dir"]),
        result["steps"],
        result["seconds"],
        result["history"],
        result.get("stop"),
        generated_by=result.get("generated_by"),
        selection=result.get("selection"),
        holdout_seconds=result.get("holdout_seconds", 0.0),
    )


def run_forwarding_log(
    command: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    forward: Callable[[str], None] | None = None,
) -> int:
    """Run the launcher with ``env`` added; every line goes to ``log_path`` and to ``forward`` (default: rank 0's
    log lines, not progress bars, to this log)."""
    # The ranks run no flow: Prefect's API log handler has nothing to send their records to.
    env = {
        **os.environ,
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        "PYTHONWARNINGS": "ignore::FutureWarning",
        **(env or {}),
    }
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
        ) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            log.flush()
            if forward is not None:
                forward(line)
            elif line.startswith("[rank 0] "):
                logger.info("%s", line.rstrip()[len("[rank 0] ") :])
        return process.wait()


def rank_error(launch_dir: Path, stage: str, returncode: int) -> Exception:
    """The error to raise for a failed group: the first failing rank's own error (a grpoflow error keeps its
    type, so a gate stop on a rank is still a gate stop), else the launcher's exit code and its log's tail."""
    reports = sorted(
        (json.loads(path.read_text()) for path in launch_dir.glob("rank-*.error.json")), key=lambda r: r["time"]
    )
    if not reports:
        tail = (launch_dir / "ranks.log").read_text(errors="replace").strip().splitlines()[-5:]
        return TrainingProcessError(
            f"{stage}: the training processes exited with code {returncode} and no rank reported an error; "
            f"last lines of {launch_dir / 'ranks.log'}: {' | '.join(tail)}"
        )
    first = reports[0]
    message = f"{stage} rank {first['rank']}: {first['message']}"
    return reported_error(first, message, f"every rank was stopped; log: {launch_dir}/ranks.log")


def reported_error(report: dict[str, Any], message: str, after: str) -> Exception:
    """The error a rank reported, as the stage raises it: grpoflow's own error types keep their type (a gate stop
    on a rank is still a gate stop, exit 3), anything else is a ``TrainingProcessError`` naming the type.

    >>> type(reported_error({"module": "tasks.errors", "type": "GateStop"}, "grpo rank 1: no signal", "")).__name__
    'GateStop'
    >>> str(reported_error({"module": "builtins", "type": "ValueError"}, "grpo rank 1: bad", "log: x"))
    'grpo rank 1: bad (ValueError); log: x'
    """
    error_type = None
    if str(report.get("module", "")).split(".")[0] in ("tasks", "reward_fns"):  # never import what a node names
        try:
            error_type = getattr(importlib.import_module(report["module"]), report["type"])
        except (ImportError, AttributeError):
            error_type = None
    if isinstance(error_type, type) and issubclass(error_type, Exception):
        try:
            return error_type(message)
        except TypeError:
            pass
    return TrainingProcessError(f"{message} ({report['type']}); {after}")
