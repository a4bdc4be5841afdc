"""The Slurm launcher for real: a one-host Slurm cluster (Debian's slurmctld, slurmd and munge, one slurmd: the
job takes ``--nodes=1 --ntasks=2``), the generated sbatch script submitted with ``sbatch``, both agents training
with their node rank from ``$SLURM_PROCID`` and MLflow between them and the stage."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.pipeline import pipeline
from flows.services import free_port
from tasks.config import PipelineConfig

pytestmark = pytest.mark.xdist_group("nodes")
SLURM_CONF = """ClusterName=grpoflow-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0:
        pytest.skip("Slurm (slurmctld, slurmd, munge) is not installed here, or not as root: `make slurm-deps`")
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    root = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    conf = root / "slurm.conf"
    host = socket.gethostname()
    conf.write_text(
        SLURM_CONF.format(host=host, ctld_port=free_port(), d_port=free_port(), root=root, cpus=os.cpu_count())
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(conf))  # sbatch, squeue and scancel, and the job's own steps
        daemons = [subprocess.Popen([daemon, "-D", "-f", str(conf)]) for daemon in ("slurmctld", "slurmd")]
        try:
            deadline = time.monotonic() + 60
            while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout:
                assert time.monotonic() < deadline, (root / "slurmctld.log").read_text()[-2000:]
                time.sleep(0.5)
            yield root
        finally:
            for daemon in daemons:
                daemon.terminate()
                daemon.wait(timeout=30)


def test_the_generated_sbatch_script_trains_on_two_slurm_tasks(
    tiny_config: PipelineConfig, mlflow_server, slurm_cluster: Path
) -> None:
    raw = tiny_config.model_dump()
    raw["sft"]["enabled"] = False
    raw["probe"]["enabled"] = False
    raw["orchestration"].update(
        nodes=2, launcher="slurm", rendezvous_port=29441, slurm={"one_host": True, "time": "00:20:00"}
    )
    raw["grpo"]["batch_size"] = 4
    raw["model"]["precision"] = "bf16"
    raw["tracking"].update(registered_model_name="tiny-nodes-slurm", tracking_uri=mlflow_server["uri"])
    config = PipelineConfig.model_validate(raw)
    summary = pipeline(config, "nodes-slurm")
    assert summary["promotion"]["version"] == "1"
    launch = config.output_dir / "nodes-slurm" / "grpo" / "launch"
    script = next(launch.glob("*.sbatch")).read_text()
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=2" in script and "--kill-on-bad-exit=1" in script
    client = MlflowClient(mlflow_server["uri"])
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], "tags.grpoflow.run_id = 'nodes-slurm'")
    grpo = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo")
    for node in (0, 1):  # each Slurm task was the node its SLURM_PROCID named
        folder = Path(client.download_artifacts(grpo.info.run_id, f"launch/nodes/node-{node}"))
        assert json.loads((folder / "exit.json").read_text())["returncode"] == 0
        assert f"node {node}: RANK=" in (folder / "log.txt").read_text()
