"""Two nodes on this machine (``make test-nodes``): each node agent in its own filesystem and PID namespace
(bubblewrap), the nodes meeting on loopback through torch's c10d rendezvous, and nothing but a real MLflow
tracking server between them and the stage."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from flows.pipeline import pipeline
from tasks.config import PipelineConfig

pytestmark = pytest.mark.xdist_group("nodes")
REPO = Path(__file__).resolve().parents[2]


def two_nodes(tiny_config: PipelineConfig, server: dict, name: str, port: int, **changes) -> PipelineConfig:
    raw = tiny_config.model_dump()
    raw["orchestration"] = {**raw["orchestration"], "nodes": 2, "launcher": "local", "rendezvous_port": port}
    raw["grpo"] = {**raw["grpo"], "batch_size": 4}  # per process: 2 × 4 completions = two groups of 4 per step
    raw["tracking"] = {**raw["tracking"], "registered_model_name": name, "tracking_uri": server["uri"]}
    raw["model"] = {**raw["model"], "precision": "bf16"}  # as the two-process test: TRL's generation on ranks
    return PipelineConfig.model_validate({**raw, **changes})


def stage_runs(config: PipelineConfig, run_id: str) -> dict[str, list]:
    client = MlflowClient(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.grpoflow.run_id = '{run_id}'")
    found: dict[str, list] = {}
    for run in runs:
        found.setdefault(run.data.tags.get("grpoflow.stage", "parent"), []).append(run)
    return found


def test_the_tiny_pipeline_trains_on_two_nodes_from_the_command_line_with_nothing_started_by_hand(
    tmp_path: Path,
) -> None:
    """`grpoflow run configs/tiny.yaml --set orchestration.nodes=2`, as from a fresh clone: the run's own SQLite
    store, which the run serves to the nodes itself for as long as it runs."""
    from tasks.config import load_config

    sets = [f"output_dir={tmp_path / 'out'}", "orchestration.nodes=2", "orchestration.rendezvous_port=29431"]
    # The hold-out file travels to the nodes with the train file; rank 0 scores it at every step, the rest wait.
    sets += ["grpo.eval_steps=1", "grpo.eval_prompts=8", "grpo.select=best", "model.precision=bf16"]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(REPO / "configs" / "tiny.yaml"), "--run-id", "tiny-nodes"]
        + [f"--set={item}" for item in sets],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    config = load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(tmp_path / "out")})
    summary = json.loads((config.output_dir / "tiny-nodes" / "summary.json").read_text())
    assert summary["promotion"]["version"] == "1"
    assert summary["grpo"]["selected"]["select"] == "best"
    assert summary["mlflow"]["tracking_uri"].startswith("sqlite:")  # the store, read directly after the run
    served = re.search(
        r"MLflow server (http://127\.0\.0\.1:\d+) over .*mlflow\.db for the nodes", done.stdout + done.stderr
    )
    assert served, done.stderr[-3000:]
    with pytest.raises(OSError):  # stopped with the run
        urllib.request.urlopen(f"{served.group(1)}/health", timeout=5)
    client = MlflowClient(summary["mlflow"]["tracking_uri"])
    runs = stage_runs(config, "tiny-nodes")
    for stage, steps in (("sft", config.sft.max_steps), ("grpo", config.grpo.max_steps)):
        assert len(runs[stage]) == 1, stage  # one MLflow stage run, not one per node or rank
        run = runs[stage][0]
        loss = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in loss) == list(range(1, steps + 1)), stage  # each step logged once
        assert run.data.tags["nodes"] == "2"
        if stage == "grpo":
            scored = client.get_metric_history(run.info.run_id, "eval_holdout_pass_at_1")
            assert sorted(m.step for m in scored) == list(range(1, steps + 1))
        for node in (0, 1):
            folder = Path(client.download_artifacts(run.info.run_id, f"launch/nodes/node-{node}"))
            exit_report = json.loads((folder / "exit.json").read_text())
            assert exit_report["returncode"] == 0 and exit_report["ranks_finished"], (stage, node)
            log = (folder / "log.txt").read_text()
            assert f"node {node}: RANK=" in log and "WORLD_SIZE=2" in log, (stage, node)
    assert summary["evaluation"]["models"]["grpo"]["n_samples"] == config.evaluation.n_samples


def grpo_only(config: PipelineConfig, **grpo) -> PipelineConfig:
    raw = config.model_dump()
    raw["sft"]["enabled"] = False
    raw["probe"]["enabled"] = False
    raw["grpo"].update(grpo)
    return PipelineConfig.model_validate(raw)


def test_same_seed_on_two_nodes_twice_gives_the_same_adapter(tiny_config: PipelineConfig, mlflow_server) -> None:
    config = grpo_only(two_nodes(tiny_config, mlflow_server, "tiny-nodes-seed", 29433))
    adapters = []
    for run_id in ("seed-a", "seed-b"):
        pipeline(config, run_id)
        adapters.append((config.output_dir / run_id / "grpo" / "adapter" / "adapter_model.safetensors").read_bytes())
    assert adapters[0] == adapters[1]


SLOW_REWARD = """
import time

def slow_length(completions, **kwargs):
    time.sleep(0.3)  # each GRPO step long enough to kill a node between checkpoints
    return [-abs(8 - len(c if isinstance(c, str) else c[-1]["content"])) / 8 for c in completions]
"""


def _cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *args],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _parent_run(client: MlflowClient, experiment: str, run_id: str):
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], f"tags.grpoflow.run_id = '{run_id}'")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return parents[0] if parents else None


def test_a_node_killed_whole_ends_the_stage_and_resume_brings_both_back(
    tiny_config: PipelineConfig, mlflow_server, tmp_path: Path
) -> None:
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    config = grpo_only(
        two_nodes(
            tiny_config,
            mlflow_server,
            "tiny-nodes-kill",
            29437,
            rewards=[{"name": "slowreward:slow_length", "path": str(tmp_path)}],
            canaries={"enabled": False},
        ),
        max_steps=8,
        checkpoint_steps=2,
    )
    config_path = tmp_path / "kill.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    client = MlflowClient(mlflow_server["uri"])

    first = _cli([str(config_path), "--run-id", "nodes-kill"])
    deadline = time.monotonic() + 300
    second_checkpoint = {"checkpoint-4.node-0.complete", "checkpoint-4.node-1.complete"}
    while True:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the nodes never completed their second checkpoint"
        parent = _parent_run(client, config.tracking.experiment_name, "nodes-kill")
        if parent is not None:
            names = {Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "handoff/grpo-checkpoints")}
            if second_checkpoint <= names:
                break
        time.sleep(0.2)
    stored = {
        Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "handoff/grpo-checkpoints/checkpoint-4")
    }
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= stored  # both nodes' random states, each from its own node
    nodes = json.loads((config.output_dir / "nodes-kill" / "grpo" / "launch" / "nodes.json").read_text())
    killed_at = time.time()
    os.killpg(nodes["1"]["process_group"], signal.SIGKILL)  # node 1 whole: agent, launcher and ranks
    output, _ = first.communicate(timeout=180)
    assert first.returncode == 4, output[-3000:]
    assert "node 1 ended without reporting (node 1: killed by signal 9 (SIGKILL))" in output, output[-3000:]
    failed = [
        r
        for r in client.search_runs([parent.info.experiment_id], "tags.grpoflow.run_id = 'nodes-kill'")
        if r.data.tags.get("grpoflow.stage") == "grpo"
    ]
    node_0 = Path(client.download_artifacts(failed[0].info.run_id, "launch/nodes/node-0/exit.json", str(tmp_path)))
    node_0_ended = json.loads(node_0.read_text())
    assert node_0_ended["returncode"] != 0
    seconds = node_0_ended["ended"] - killed_at
    print(f"node 0 ended {seconds:.1f} s after node 1 was killed")
    assert seconds < 30

    resumed = _cli([str(config_path), "--resume", "nodes-kill"])
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-3000:]
    grpo_runs = sorted(
        (
            r
            for r in client.search_runs([parent.info.experiment_id], "tags.grpoflow.run_id = 'nodes-kill'")
            if r.data.tags.get("grpoflow.stage") == "grpo"
        ),
        key=lambda r: r.info.start_time,
    )
    assert [r.info.status for r in grpo_runs] == ["FAILED", "FINISHED"]
    assert grpo_runs[1].data.metrics["train_steps"] == 8
    for node in (0, 1):  # every node restored the mirrored checkpoint (the RNG file of each of its processes)
        log = (config.output_dir / "nodes-kill" / "grpo" / "launch" / f"node-{node}.agent.log").read_text()
        assert "restored checkpoint-4" in log, (node, log[-2000:])


def test_the_manual_launchers_printed_commands_run_in_two_shells_train(
    tiny_config: PipelineConfig, mlflow_server, tmp_path: Path
) -> None:
    config = grpo_only(two_nodes(tiny_config, mlflow_server, "tiny-nodes-manual", 29439))
    raw = config.model_dump(mode="json")
    raw["orchestration"]["launcher"] = "manual"
    raw["orchestration"]["node_wait_timeout_s"] = 900  # required with manual: nothing else bounds the wait
    config_path = tmp_path / "manual.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    stage = _cli([str(config_path), "--run-id", "nodes-manual"])
    commands_file = config.output_dir / "nodes-manual" / "grpo" / "launch" / "commands.sh"
    deadline = time.monotonic() + 180
    while not commands_file.is_file():
        assert stage.poll() is None, stage.stdout.read()
        assert time.monotonic() < deadline, "the stage never printed the nodes' commands"
        time.sleep(0.2)
    commands = [line for line in commands_file.read_text().splitlines() if line.startswith("grpoflow node-agent")]
    assert len(commands) == 2 and all("--tracking-uri " + mlflow_server["uri"] in c for c in commands)
    bin_dir = str(Path(sys.executable).parent)
    shells = []
    for node, command in enumerate(commands):  # two shells, each with its own scratch, as two machines would
        home = tmp_path / f"machine-{node}"
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(home), "OMP_NUM_THREADS": "1"}
        env["GRPOFLOW_CACHE"] = str(home / "cache")
        home.mkdir()
        shells.append(subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE, text=True))
    for shell in shells:
        shell.communicate(timeout=600)
        assert shell.returncode == 0
    output, _ = stage.communicate(timeout=300)
    assert stage.returncode == 0, output[-3000:]
    assert "grpoflow node-agent" in output  # printed for the person who runs them
    assert json.loads((config.output_dir / "nodes-manual" / "summary.json").read_text())["promotion"]["version"]


TAMPER_REWARD = """
print("IMPORTED-{who}", flush=True)  # runs at import: a node that imports it says so in its log


def tamper_length(completions, **kwargs):
    return [-abs(8 - len(c if isinstance(c, str) else c[-1]["content"])) / 8 for c in completions]
"""


@pytest.mark.parametrize("target", ["reward module", "request", "train file"])
def test_a_tampered_input_stops_every_node_before_anything_is_imported(
    tiny_config: PipelineConfig, mlflow_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """Someone who can write the experiment's artifacts changes a file between the stage's upload and the agents'
    fetch: every node stops naming the file, and nothing of what it holds is imported (the module prints at import;
    a node's filesystem is read-only apart from its own /tmp, so its log is where an import would show)."""
    from tasks.training.nodes import stage as stage_module
    from tasks.training.nodes.agent import NodeInputTampered
    from tasks.training.nodes.exchange import INPUTS, REQUEST

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "tamper_reward.py").write_text(TAMPER_REWARD.format(who="shipped"))
    config = grpo_only(
        two_nodes(
            tiny_config,
            mlflow_server,
            "tiny-nodes-tamper",
            29437,
            rewards=[{"name": "tamper_reward:tamper_length", "path": str(tmp_path / "rewards")}],
            canaries={"enabled": False},
        )
    )
    client = MlflowClient(mlflow_server["uri"])
    real_send = stage_module.send_request
    changed = tmp_path / "changed"
    changed.mkdir()

    def send_then_tamper(artifacts, *args, **kwargs):
        sealed = real_send(artifacts, *args, **kwargs)
        if target == "reward module":
            name = f"{INPUTS}/rewards/0/tamper_reward.py"
            (changed / "tamper_reward.py").write_text(TAMPER_REWARD.format(who="tampered"))
        elif target == "request":
            name = REQUEST
            request = artifacts.fetch_json(REQUEST)
            request["config"]["rewards"][0]["args"] = {"note": "changed"}
            (changed / "request.json").write_text(json.dumps(request))
        else:
            name = f"{INPUTS}/train.jsonl"
            rows = (config.output_dir / "tamper" / "validate" / "train.jsonl").read_text().splitlines()
            (changed / "train.jsonl").write_text("\n".join(rows[:1]) + "\n")
        client.log_artifact(artifacts.run_id, str(changed / name.rsplit("/", 1)[1]), name.rsplit("/", 1)[0])
        return sealed

    monkeypatch.setattr(stage_module, "send_request", send_then_tamper)
    name = {"reward module": "rewards/0/tamper_reward.py", "request": "request.json", "train file": "train.jsonl"}
    with pytest.raises(NodeInputTampered, match=rf"launch/(inputs/)?{name[target]} differs"):
        pipeline(config, "tamper")
    logs = sorted((config.output_dir / "tamper" / "grpo" / "launch").glob("node-*.agent.log"))
    assert len(logs) == 2
    for log in logs:
        said = log.read_text()
        assert "differs from" in said and "IMPORTED" not in said, (log.name, said[-2000:])  # nothing imported
    grpo_run = stage_runs(config, "tamper")["grpo"][0]
    for node in (0, 1):
        folder = Path(client.download_artifacts(grpo_run.info.run_id, f"launch/nodes/node-{node}"))
        assert json.loads((folder / "exit.json").read_text())["returncode"] != 0, node


def test_a_tool_module_and_a_reward_model_folder_only_on_this_side_reach_both_nodes(
    tmp_path: Path, tiny_reward_model_dir: Path
) -> None:
    """Both live under this host's /tmp, which every local node has a private copy of: a node sees them only if
    the stage shipped them. The store is the default local SQLite file: the run serves it to the nodes itself."""
    from tasks.config import load_config

    tools = tmp_path / "tools"
    tools.mkdir()
    rates = (REPO / "configs" / "examples" / "exchange-tool" / "tools" / "rates.py").read_text()
    (tools / "rates.py").write_text('print("IMPORTED-rates", flush=True)\n' + rates)
    config = load_config(
        REPO / "configs" / "tiny-tools.yaml",
        {
            "output_dir": str(tmp_path / "outputs"),
            "orchestration": {"nodes": 2, "rendezvous_port": 29441},
            "sft": {"enabled": False},
            "probe": {"enabled": False},
            # As short as tool use allows: the point is what reaches the nodes, not what they learn.
            "grpo": {"max_steps": 1, "batch_size": 2, "num_generations": 2, "max_completion_length": 128},
            "evaluation": {"num_prompts": 2, "n_samples": 1, "k": [1], "max_new_tokens": 128, "forgetting": False},
            "canaries": {"judge_min_ordered": 0.0},  # a random reward model orders nothing
            "tools": {
                "max_turns": 1,
                "use": [
                    {"name": "python"},
                    {
                        "name": "rates:exchange_rate",
                        "path": str(tools),
                        "canaries": [{"arguments": {"currency": "USD"}, "expect": "0.92"}],
                    },
                ],
            },
            "rewards": [
                {"name": "math_accuracy"},
                {"name": "reward_model", "args": {"model": str(tiny_reward_model_dir)}, "weight": 0.5},
            ],
        },
    )
    assert config.resolved_tracking_uri().startswith("sqlite:")
    summary = pipeline(config, "shipped")
    assert summary["promotion"]["version"] == "1"
    assert summary["mlflow"]["tracking_uri"] == config.resolved_tracking_uri()  # the store, not the run's server
    client = MlflowClient(config.resolved_tracking_uri())  # the file itself, once the run's server is gone
    run = stage_runs(config, "shipped")["grpo"][0]
    for node in (0, 1):  # the ranks' output, as each node sent it up
        log = Path(client.download_artifacts(run.info.run_id, f"launch/nodes/node-{node}/log.txt")).read_text()
        assert "IMPORTED-rates" in log, (node, log[-2000:])
        assert "converting" not in log  # the base model came converted, from the stage
    request = json.loads(Path(client.download_artifacts(run.info.run_id, "launch/request.json")).read_text())
    assert request["tool_modules"] == [1] and request["reward_models"] == [1]
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "launch/inputs/tools/1")}
    assert names == {"rates.py"}
    import mlflow

    mlflow.set_registry_uri(config.resolved_tracking_uri())
    got = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{config.tracking.registered_model_name}/1",
        dst_path=str(tmp_path / "got"),
        tracking_uri=config.resolved_tracking_uri(),
    )
    assert any(Path(got).rglob("adapter_model.safetensors"))  # the registered version loads from the file store
