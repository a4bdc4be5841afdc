"""The Kubeflow launcher: a Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) with ``numNodes``
pods from the GPU worker image, each running the node agent, which reads its node rank and node 0's address from
the ``PET_*`` settings the torch runtime gives every pod. Applied, watched and deleted with ``kubectl``.

Must not import: Prefect, MLflow.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tasks.config import PipelineConfig
from tasks.errors import InfrastructureError, UserError

logger = logging.getLogger(__name__)

API_VERSION = "trainer.kubeflow.org/v1alpha1"


class KubectlMissing(UserError, RuntimeError):
    """``orchestration.launcher: kubeflow`` on a machine without ``kubectl``."""


class KubeflowError(InfrastructureError, RuntimeError):
    """The cluster refused the TrainJob or cannot be asked about it."""


def resource_name(run_id: str, stage: str) -> str:
    """A TrainJob name (a DNS label: lower case, digits and '-', at most 63, starting with a letter).

    >>> resource_name("Tiny_Run 2026", "grpo")
    'grpoflow-tiny-run-2026-grpo'
    """
    name = re.sub(r"[^a-z0-9-]+", "-", f"grpoflow-{run_id}-{stage}".lower()).strip("-")
    return name[:63].rstrip("-")


def train_job(config: PipelineConfig, agent: list[str], name: str, tracking_uri: str) -> dict[str, Any]:
    """The TrainJob for a stage's nodes: ``orchestration.nodes`` pods, ``num_processes`` per pod (``auto``: one
    per GPU), each running ``agent`` (its node rank from ``PET_NODE_RANK``).

    >>> cfg = PipelineConfig.model_validate({"orchestration": {"nodes": 2, "launcher": "kubeflow"}})
    >>> job = train_job(cfg, ["python", "-m", "tasks.training.nodes.agent"], "grpoflow-r-grpo", "http://mlflow:5000")
    >>> job["kind"], job["spec"]["trainer"]["numNodes"], job["spec"]["runtimeRef"]["name"]
    ('TrainJob', 2, 'torch-distributed')
    """
    kubeflow = config.orchestration.kubeflow
    trainer: dict[str, Any] = {
        "image": kubeflow.image,
        "command": ["python", *agent[1:]],  # the image's interpreter, not this machine's path
        "numNodes": config.orchestration.nodes,
        "env": [
            {"name": "MLFLOW_TRACKING_URI", "value": tracking_uri},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            *(
                {"name": name, "valueFrom": {"secretKeyRef": {"name": kubeflow.env_secret, "key": name}}}
                for name in config.orchestration.env
            ),
        ],
    }
    if config.orchestration.num_processes:
        trainer["numProcPerNode"] = config.orchestration.num_processes
    if kubeflow.gpus_per_node:
        gpus = str(kubeflow.gpus_per_node)
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    spec: dict[str, Any] = {
        "runtimeRef": {"name": kubeflow.runtime, "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
        "trainer": trainer,
    }
    if kubeflow.service_account:
        spec["podTemplateOverrides"] = [
            {"targetJobs": [{"name": "node"}], "spec": {"serviceAccountName": kubeflow.service_account}}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {
            "name": name,
            "namespace": kubeflow.namespace,
            "labels": {"app.kubernetes.io/part-of": "grpoflow"},
        },
        "spec": spec,
    }


class KubeflowJob:
    """A stage's nodes as one TrainJob."""

    def __init__(self, config: PipelineConfig, agent: list[str], launch_dir: Path, name: str, tracking_uri: str):
        self.manifest = train_job(config, agent, name, tracking_uri)
        self.name, self.namespace = name, config.orchestration.kubeflow.namespace
        self.path = launch_dir / f"{name}.trainjob.yaml"
        self.description = f"TrainJob {self.namespace}/{name} ({self.path})"

    def _kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        if shutil.which("kubectl") is None:
            raise KubectlMissing("orchestration.launcher is kubeflow, but kubectl is not on this machine's PATH")
        return subprocess.run(["kubectl", "-n", self.namespace, *args], capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(yaml.safe_dump(self.manifest, sort_keys=False))
        done = self._kubectl("apply", "-f", str(self.path))
        if done.returncode != 0:
            raise KubeflowError(f"kubectl apply refused {self.path}: {done.stderr.strip()}")
        logger.info("created %s", self.description)

    def state(self) -> str:
        done = self._kubectl("get", "trainjob", self.name, "-o", "json")
        if done.returncode != 0:
            return "ended" if "NotFound" in done.stderr else "unknown"
        conditions = json.loads(done.stdout).get("status", {}).get("conditions", [])
        finished = {c.get("type") for c in conditions if c.get("status") == "True"} & {"Complete", "Failed"}
        return "ended" if finished else "running"

    def ends(self) -> dict[int, str]:
        return {}

    def cancel(self) -> None:
        self._kubectl("delete", "trainjob", self.name, "--wait=false")
        logger.warning("deleted %s", self.description)
