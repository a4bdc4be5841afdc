"""The Slurm launcher: an sbatch script shaped like open-r1's ``slurm/train.slurm`` (one task per node, ``srun
--kill-on-bad-exit=1``, the first host as the rendezvous), submitted with ``sbatch``, watched with ``squeue`` and
cancelled with ``scancel``. Each task runs the node agent, which takes its node rank from ``$SLURM_PROCID``.

Must not import: Prefect, MLflow.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.errors import InfrastructureError, UserError

logger = logging.getLogger(__name__)


class SlurmError(InfrastructureError, RuntimeError):
    """Slurm refused the job or cannot be asked about it."""


class SlurmMissing(UserError, RuntimeError):
    """``orchestration.launcher: slurm`` on a machine without ``sbatch``."""


def job_name(run_id: str, stage: str) -> str:
    """A Slurm job name for a stage of a run.

    >>> job_name("tiny 2026/12", "grpo")
    'grpoflow-tiny-2026-12-grpo'
    """
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"grpoflow-{run_id}-{stage}")


CHECKED_EXEC = (
    'command -v "$0" >/dev/null || { echo "grpoflow: $0 (orchestration.node_python) does not run on $(hostname)" >&2; '
    'exit 2; }; exec "$0" "$@"'
)


def sbatch_script(config: PipelineConfig, agent: list[str], name: str) -> str:
    """The batch script: ``orchestration.nodes`` tasks, one per host (all on one host with ``slurm.one_host``),
    each running ``agent`` with the job's first host as node 0's address.

    >>> cfg = PipelineConfig.model_validate({"orchestration": {"nodes": 2, "launcher": "slurm"}})
    >>> script = sbatch_script(cfg, ["python", "-m", "tasks.training.nodes.agent"], "job")
    >>> "#SBATCH --nodes=2" in script and "srun --nodes=2 --ntasks=2 --kill-on-bad-exit=1" in script
    True
    """
    orchestration, slurm = config.orchestration, config.orchestration.slurm
    nodes = orchestration.nodes
    hosts = 1 if slurm.one_host else nodes
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={hosts}"]
    lines += [f"#SBATCH --ntasks={nodes}" if slurm.one_host else "#SBATCH --ntasks-per-node=1"]
    lines += [f"#SBATCH --time={slurm.time}", f"#SBATCH --output={name}-%j.out"]
    if slurm.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{slurm.gpus_per_node}")
    for key in ("partition", "account"):
        if getattr(slurm, key):
            lines.append(f"#SBATCH --{key}={getattr(slurm, key)}")
    if orchestration.env:  # by name: Slurm copies the values from the submitting shell, never the script
        lines.append(f"#SBATCH --export=ALL,{','.join(orchestration.env)}")
    lines += [f"#SBATCH {extra}" for extra in slurm.extra]
    lines += [
        "set -euo pipefail",
        "# Node 0 hosts torch's rendezvous store on the job's first host; every task's SLURM_PROCID is its node rank.",
        'GRPOFLOW_RENDEZVOUS_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export GRPOFLOW_RENDEZVOUS_HOST",
        f'echo "grpoflow: {nodes} nodes, rendezvous $GRPOFLOW_RENDEZVOUS_HOST:{orchestration.rendezvous_port}"',
        # Each task first checks that the interpreter runs on its host (orchestration.node_python), so a path that
        # exists only on the submitting machine is one line naming it, not a bare "No such file".
        f"srun --nodes={hosts} --ntasks={nodes} --kill-on-bad-exit=1 bash -c {shlex.quote(CHECKED_EXEC)} "
        f"{shlex.join(agent)}",
    ]
    return "\n".join(lines) + "\n"


class SlurmJob:
    """A stage's nodes as one Slurm batch job."""

    def __init__(self, config: PipelineConfig, agent: list[str], launch_dir: Path, name: str) -> None:
        self.script_path = launch_dir / f"{name}.sbatch"
        self.script, self.launch_dir, self.job_id = sbatch_script(config, agent, name), launch_dir, ""
        self.description = f"Slurm job {name} ({self.script_path})"

    def start(self) -> None:
        if shutil.which("sbatch") is None:
            raise SlurmMissing("orchestration.launcher is slurm, but sbatch is not on this machine's PATH")
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        self.script_path.write_text(self.script)
        done = subprocess.run(
            ["sbatch", "--parsable", str(self.script_path)], capture_output=True, text=True, cwd=self.launch_dir
        )
        if done.returncode != 0:
            raise SlurmError(f"sbatch refused {self.script_path}: {done.stderr.strip() or done.stdout.strip()}")
        self.job_id = done.stdout.strip().split(";")[0]
        self.description = f"Slurm job {self.job_id} ({self.script_path})"
        logger.info("submitted %s", self.description)

    def state(self) -> str:
        done = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], capture_output=True, text=True)
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            return "unknown"
        return "running" if done.stdout.strip() else "ended"

    def ends(self) -> dict[int, str]:
        return {}

    def cancel(self) -> None:
        if self.job_id:
            subprocess.run(["scancel", self.job_id], capture_output=True)
            logger.warning("cancelled %s", self.description)
