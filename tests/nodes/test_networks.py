"""Two nodes on networks of their own (``make test-nodes``): each in a network namespace, meeting node 0 and
MLflow over a bridge, with this host's name resolving to loopback in both. A node whose link goes down mid-step
(its sockets left open, as when a host vanishes) ends the stage within the bound its heartbeat sets, named; the
resumed run then trains on both nodes to the end. A failure one node reports ends the stage within seconds, named,
keeping its kind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from flows.pipeline import pipeline
from tasks.config import PipelineConfig
from tasks.errors import GateStop
from tasks.training.nodes.stage import FAILURE_GRACE_S
from tests.nodes.test_two_nodes import SLOW_REWARD, _cli, _parent_run, grpo_only, stage_runs, two_nodes

pytestmark = pytest.mark.xdist_group("nodes")
HEARTBEAT_TIMEOUT_S = 15.0


def test_a_node_whose_link_goes_down_mid_step_is_named_within_the_bound_and_resume_completes(
    tiny_config: PipelineConfig, separate_networks: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    server = separate_networks["mlflow"]
    config = grpo_only(
        two_nodes(
            tiny_config,
            server,
            "tiny-nodes-netns",
            29443,
            rewards=[{"name": "slowreward:slow_length", "path": str(tmp_path)}],
            canaries={"enabled": False},
        ),
        max_steps=8,
        checkpoint_steps=2,
    )
    raw = config.model_dump(mode="json")
    raw["orchestration"].update(
        local_network_namespaces=separate_networks["namespaces"],
        rendezvous_host=separate_networks["addresses"][0],
        node_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        collective_timeout_s=120,
    )
    config_path = tmp_path / "netns.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    client = MlflowClient(server["uri"])

    first = _cli([str(config_path), "--run-id", "netns"])
    deadline = time.monotonic() + 300
    second_checkpoint = {"checkpoint-4.node-0.complete", "checkpoint-4.node-1.complete"}
    while True:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the nodes never completed their second checkpoint"
        parent = _parent_run(client, config.tracking.experiment_name, "netns")
        if parent is not None:
            names = {Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "handoff/grpo-checkpoints")}
            if second_checkpoint <= names:
                break
        time.sleep(0.2)
    link = separate_networks["host_links"][1]
    cut_at = time.monotonic()
    subprocess.run(["ip", "link", "set", link, "down"], check=True)  # node 1 is cut off; its sockets stay open
    try:
        output, _ = first.communicate(timeout=180)
        ended_after = time.monotonic() - cut_at
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    print(f"the stage ended {ended_after:.1f} s after node 1's link went down")
    assert first.returncode == 4, output[-3000:]
    assert "node 1 went silent: no heartbeat for" in output, output[-3000:]
    # The bound: the heartbeat timeout, one beat's interval, a poll, the launcher's stop (10 s) and the CLI's exit.
    assert ended_after < HEARTBEAT_TIMEOUT_S + 5 + 2 + 10 + 15

    for node, address in enumerate(separate_networks["addresses"]):  # met over the bridge, not on loopback
        log = (config.output_dir / "netns" / "grpo" / "launch" / f"node-{node}.agent.log").read_text()
        assert f"PET_LOCAL_ADDR={address}" in log and "GLOO_SOCKET_IFNAME=gfv" in log, log[-2000:]

    resumed = _cli([str(config_path), "--resume", "netns"])
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-3000:]
    for node in (0, 1):
        log = (config.output_dir / "netns" / "grpo" / "launch" / f"node-{node}.agent.log").read_text()
        assert "restored checkpoint-4" in log, (node, log[-2000:])
    grpo = [
        run
        for run in client.search_runs([parent.info.experiment_id], "tags.grpoflow.run_id = 'netns'")
        if run.data.tags.get("grpoflow.stage") == "grpo"
    ]
    assert sorted(run.info.status for run in grpo) == ["FAILED", "FINISHED"]
    assert next(run for run in grpo if run.info.status == "FINISHED").data.metrics["train_steps"] == 8


def test_an_error_on_node_1_ends_the_stage_within_seconds_as_a_gate_stop_naming_it(
    tiny_config: PipelineConfig, separate_networks: dict[str, Any], tmp_path: Path
) -> None:
    """A reward that cannot judge on node 1 only: its rank stops (the None-share gate) and reports; node 0's rank
    would wait for it in the next collective; the stage raises node 1's own error within seconds."""
    (tmp_path / "node_reward.py").write_text(
        "import os\n"
        "def judged_on_node_0(completions, **kwargs):\n"
        "    return [None if os.environ.get('GRPOFLOW_NODE_RANK') == '1' else 1.0 for _ in completions]\n"
    )
    config = grpo_only(
        two_nodes(
            tiny_config,
            separate_networks["mlflow"],
            "tiny-nodes-gate",
            29445,
            rewards=[{"name": "node_reward:judged_on_node_0", "path": str(tmp_path)}],
            canaries={"enabled": False},
        )
    )
    raw = config.model_dump(mode="json")
    raw["orchestration"].update(
        local_network_namespaces=separate_networks["namespaces"], rendezvous_host=separate_networks["addresses"][0]
    )
    config = PipelineConfig.model_validate(raw)
    with pytest.raises(GateStop, match=r"grpo node 1 rank 1: reward judged_on_node_0 could not judge"):
        pipeline(config, "nodes-gate")
    ended = time.time()
    client = MlflowClient(config.resolved_tracking_uri())
    grpo = stage_runs(config, "nodes-gate")["grpo"][0]
    errors = client.list_artifacts(grpo.info.run_id, "launch/nodes/node-1/errors")
    reported = min(
        json.loads(Path(client.download_artifacts(grpo.info.run_id, error.path)).read_text())["time"]
        for error in errors
    )
    print(f"the stage ended {ended - reported:.1f} s after node 1 reported its error")
    assert ended - reported < FAILURE_GRACE_S + 10  # the others' grace, a poll, the launcher's stop
