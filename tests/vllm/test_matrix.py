"""Every feature with every other (``make test-matrix``): short real pipelines on the tiny models, each case turning
on several features at once, so each pair of features runs together in at least one case, or is refused at load
with one line naming both keys. Each case checks what it must show: a registered version, the engine named in the
summary and the ledger, GRPO's samples in the ledger, and what its features leave behind (tool turns, judge
verdicts, every hold-out evaluation, two ranks, bf16, two iterations per batch).

Two nodes are local nodes under bubblewrap with a real MLflow server between them and the stage (as
``make test-nodes`` runs them).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from flows.pipeline import pipeline
from flows.services import free_port
from tasks.config import load_config
from tasks.training import read_ledger

pytestmark = pytest.mark.matrix

REPO = Path(__file__).resolve().parents[2]
FEATURES = (
    "tools",
    "llm_judge",
    "reward_model",
    "vllm_colocate",
    "vllm_server",
    "two_processes",
    "select_best",
    "bf16",
    "off_policy",
    "two_nodes",
)
# Pairs that are one key's two values, not two features: never together.
EXCLUSIVE = {frozenset(("vllm_colocate", "vllm_server"))}
CASES = {
    "tools-judge-bf16-offpolicy": ("tools", "llm_judge", "bf16", "off_policy"),
    "tools-rewardmodel-selectbest-colocate": ("tools", "reward_model", "select_best", "vllm_colocate"),
    "judge-twoprocesses-selectbest-colocate": ("llm_judge", "two_processes", "select_best", "vllm_colocate"),
    "selectbest-server-bf16-rewardmodel": ("select_best", "vllm_server", "bf16", "reward_model"),
    "bf16-colocate-offpolicy-twoprocesses": ("bf16", "vllm_colocate", "off_policy", "two_processes"),
    "judge-server-rewardmodel-offpolicy": ("llm_judge", "vllm_server", "reward_model", "off_policy"),
    "judge-rewardmodel-twoprocesses-bf16": ("llm_judge", "reward_model", "two_processes", "bf16"),
    "tools-colocate-offpolicy-selectbest": ("tools", "vllm_colocate", "off_policy", "select_best"),
    "judge-selectbest-offpolicy-tools": ("llm_judge", "select_best", "off_policy", "tools"),
    "server-offpolicy-tools-bf16": ("vllm_server", "off_policy", "bf16", "tools"),
    "colocate-judge-bf16": ("vllm_colocate", "llm_judge", "bf16"),
    "twoprocesses-rewardmodel-tools": ("two_processes", "reward_model", "tools"),
    "twoprocesses-selectbest-bf16": ("two_processes", "select_best", "bf16"),
    "rewardmodel-colocate-bf16": ("reward_model", "vllm_colocate", "bf16"),
    "selectbest-offpolicy-rewardmodel": ("select_best", "off_policy", "reward_model"),
    "twoprocesses-server-judge": ("two_processes", "vllm_server", "llm_judge"),
    "nodes-tools-judge-selectbest": ("two_nodes", "tools", "llm_judge", "select_best"),
    "nodes-rewardmodel-colocate-offpolicy": ("two_nodes", "reward_model", "vllm_colocate", "off_policy"),
    "nodes-server-bf16": ("two_nodes", "vllm_server", "bf16"),
    "nodes-twoprocesses": ("two_nodes", "two_processes"),
}


def all_pairs() -> set[frozenset[str]]:
    """Every pair of features that can be on together."""
    return {frozenset(pair) for pair in itertools.combinations(FEATURES, 2)} - EXCLUSIVE


# Combinations refused at load (each of their pairs runs in CASES): the features, and the one line that names the keys.
REFUSED = {
    (
        "tools",
        "vllm_server",
        "two_processes",
    ): r"^\(top level\): tools\.use with grpo\.generation\.vllm_mode server on 2 processes",
}


def test_a_refused_combination_is_one_line_naming_its_keys(tmp_path: Path) -> None:
    """TRL 1.16's tool loop on a vLLM server gathers each round's turns from every rank at once, and ranks with
    different numbers of rollouts still calling tools fall out of step (an IndexError in one CI run; a hang when a
    rank has none left): refused at load, before any work, rather than failing at a random step."""
    from types import SimpleNamespace

    from tasks.config import ConfigError

    fake = {"plain": SimpleNamespace(url="http://127.0.0.1:9"), "tools": SimpleNamespace(url="http://127.0.0.1:9")}
    for features, message in REFUSED.items():
        base = "tiny-tools.yaml" if "tools" in features else "tiny.yaml"
        with pytest.raises(ConfigError) as refused:
            load_config(REPO / "configs" / base, _overrides(features, tmp_path, fake))
        reason = str(refused.value).splitlines()[-1].strip()
        assert re.search(message, reason), reason
        covered = {frozenset(pair) for case in CASES.values() for pair in itertools.combinations(case, 2)}
        assert {frozenset(pair) for pair in itertools.combinations(features, 2)} <= covered


def test_the_cases_cover_every_pair() -> None:
    covered = {frozenset(pair) for case in CASES.values() for pair in itertools.combinations(case, 2)}
    assert not covered & EXCLUSIVE
    missing = sorted(tuple(sorted(pair)) for pair in all_pairs() - covered)
    assert not missing, f"pairs no case runs: {missing}"


def base_source(tools: bool) -> str:
    """The model source of the case's base config (configs/tiny-tools.yaml or tiny.yaml)."""
    return load_config(REPO / "configs" / ("tiny-tools.yaml" if tools else "tiny.yaml")).model.source


def _overrides(
    features: tuple[str, ...], output_dir: Path, servers: dict[str, Any], tracking_uri: str | None = None
) -> dict[str, Any]:
    from tasks.models import TINY_RANDOM_VLLM, TINY_RANDOM_VLLM_TOOLS, resolve_model_source

    tools = "tools" in features
    vllm = {"vllm_colocate", "vllm_server"} & set(features)
    values: dict[str, Any] = {"output_dir": str(output_dir), "model.precision": "fp32", "evaluation.forgetting": False}
    if vllm:
        values |= {
            "model.source": TINY_RANDOM_VLLM_TOOLS if tools else TINY_RANDOM_VLLM,
            "grpo.generation.backend": "vllm",
            "grpo.generation.vllm_max_model_len": 1024 if tools else 512,
        }
    if tools:
        values |= {"probe.num_prompts": 2, "evaluation.num_prompts": 2}
    if "vllm_server" in features:
        values |= {
            "grpo.generation.vllm_mode": "server",
            "grpo.generation.vllm_server_base_url": servers["tools" if tools else "plain"].url,
            "grpo.generation.vllm_server_timeout_s": 60,
        }
    if "two_processes" in features:
        values |= {"orchestration.num_processes": 2, "grpo.batch_size": 4}
    if "select_best" in features:
        values |= {"grpo.eval_steps": 1, "grpo.eval_prompts": 4, "grpo.select": "best"}
    if "bf16" in features:
        values["model.precision"] = "bf16"
    if "off_policy" in features:
        values |= {"grpo.num_iterations": 2, "grpo.loss_type": "dapo"}
    if "two_nodes" in features:  # local nodes under bubblewrap, an MLflow server between them and the stage
        # The model as a folder, which the stage ships: a tiny model built on each node by name need not come out
        # byte for byte the same (the nodes refuse one that does not, NodeInputError).
        values["model.source"] = str(resolve_model_source(values.get("model.source") or base_source(tools)))
        values |= {
            "orchestration.nodes": 2,
            "orchestration.launcher": "local",
            "orchestration.rendezvous_port": free_port(),
            "grpo.batch_size": 4,
            "tracking.tracking_uri": tracking_uri,
        }
        if "vllm_server" in features:  # the folder the nodes hand each synced adapter over in, which the server reads
            values["grpo.generation.vllm_adapter_dir"] = str(output_dir.parent / "handover")
    return values


def _rewards(config: Any, features: tuple[str, ...], judge_url: str, reward_model_dir: Path, name: str) -> list:
    rewards = [spec.model_dump() for spec in config.rewards]
    if "llm_judge" in features:
        args = {"url": judge_url, "model": "judge", "model_digest": f"rule-{name}"}
        rewards.append({"name": "llm_judge", "args": args, "weight": 0.5})
    if "reward_model" in features:
        rewards.append({"name": "reward_model", "args": {"model": str(reward_model_dir)}, "weight": 0.5})
    return rewards


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A vLLM server per base model the cases ask for (vLLM's tiny model; its tool-calling twin), started once."""
    from tasks.models import TINY_RANDOM_VLLM_TOOLS
    from tests.vllm.conftest import VLLM_OVERRIDES, ServerProcess

    folder = tmp_path_factory.mktemp("servers")
    made = {
        "plain": ServerProcess(folder / "plain.log"),
        "tools": ServerProcess(
            folder / "tools.log",
            "tiny-tools.yaml",
            {**VLLM_OVERRIDES, "model.source": TINY_RANDOM_VLLM_TOOLS, "grpo.generation.vllm_max_model_len": 1024},
        ),
    }
    yield made
    for server in made.values():
        server.stop()


def server_of(features: tuple[str, ...]) -> str | None:
    """Which of the two vLLM servers a case needs (None: neither)."""
    if "vllm_server" not in features:
        return None
    return "tools" if "tools" in features else "plain"


# Cases without a server first, then each server's cases together: one vLLM server runs at a time (two starting and
# serving side by side on this machine's two cores, beside a case's own training, once took past their start timeout).
ORDER = sorted(CASES, key=lambda name: ("", "plain", "tools").index(server_of(CASES[name]) or ""))


@pytest.mark.parametrize("name", ORDER)
def test_the_features_of_a_case_work_together(
    name: str, servers: Any, judge_server: Any, tiny_reward_model_dir: Path, tmp_path: Path, request: Any
) -> None:
    features = CASES[name]
    wanted = server_of(features)
    if wanted:
        for other, server in servers.items():
            if other != wanted:
                server.stop()
        servers[wanted].ensure_up()
    tracking_uri = request.getfixturevalue("mlflow_server")["uri"] if "two_nodes" in features else None
    base = "tiny-tools.yaml" if "tools" in features else "tiny.yaml"
    config = load_config(REPO / "configs" / base, _overrides(features, tmp_path / "outputs", servers, tracking_uri))
    raw = config.model_dump()
    raw["rewards"] = _rewards(config, features, judge_server.url, tiny_reward_model_dir, name)
    raw["canaries"] = {**raw["canaries"], "judge_min_ordered": 0.0}  # the tiny reward model orders nothing
    raw["tracking"] = {**raw["tracking"], "registered_model_name": f"matrix-{name}"}
    config = type(config).model_validate(raw)

    summary = pipeline(config, name)
    assert summary["promotion"]["version"] == "1", summary["promotion"]
    engine = "vllm-server" if "vllm_server" in features else "vllm-colocate" if "vllm_colocate" in features else None
    if engine:
        assert summary["evaluation"]["engine"] == engine
    ledger = read_ledger(config.output_dir / name / "grpo" / "rollouts")
    grpo = [row for row in ledger if row["role"] == "grpo"]
    # a batch is drawn every num_iterations steps (the off-policy loss trains on it twice): its step is the first
    drawn = set(range(1, config.grpo.max_steps + 1, config.grpo.num_iterations))
    assert grpo and {row["step"] for row in grpo} == drawn
    assert {row["backend"] for row in grpo} == {engine or "transformers"}
    if "tools" in features:
        assert all("turns" in row for row in grpo)
    for judge in ("llm_judge", "reward_model"):
        if judge in features:
            assert all(row.get(f"reward/{judge}") is not None for row in grpo), judge
    ranks = (2 if "two_processes" in features else 1) * (2 if "two_nodes" in features else 1)
    assert {row["rank"] for row in grpo} == set(range(ranks))
    if "select_best" in features:
        assert summary["grpo"]["selected"]["select"] == "best"
        evaluated = {row["step"] for row in ledger if row["role"] == "eval"}
        assert evaluated == set(range(1, config.grpo.max_steps + 1))
