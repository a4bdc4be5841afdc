"""The one configuration model every stage reads: ``PipelineConfig``, the settings of ``settings.py`` put
together, with the checks that span sections and the hash that keys a run's cache.
Must not import: torch, transformers, Prefect, MLflow.

>>> cfg = PipelineConfig.model_validate({"grpo": {"num_generations": 4, "batch_size": 8}})
>>> cfg.grpo.num_generations, cfg.model.source
(4, 'smollm2-135m-instruct')
>>> PipelineConfig.model_validate({"grpo": {"num_generation": 4}})
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for PipelineConfig
grpo.num_generation
  Extra inputs are not permitted [type=extra_forbidden, input_value=4, input_type=int]
...
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml
from pydantic import Field, field_validator, model_validator

from tasks.config.grpo_loss import GRPOLossSettings
from tasks.config.grpo_steering import GRPOSteeringSettings
from tasks.config.operations import OrchestrationSettings, ServingSettings, TrackingSettings, WatchSettings
from tasks.config.settings import (
    CanarySettings,
    DataSettings,
    EvaluationSettings,
    GRPOSettings,
    LoraSettings,
    ModelSettings,
    ProbeSettings,
    PromotionSettings,
    RewardSpec,
    SFTSettings,
    _Strict,
)
from tasks.config.tools import ToolSettings, tool_problems

# Keys added since configs were first hashed: hashed only when set away from their default.
ADDED_LATER = (
    "grpo.generation.vllm_server_timeout_s",
    "grpo.generation.vllm_kv_cache_gib",
    "grpo.generation.vllm_adapter_dir",
    "grpo.generation.vllm_max_model_len",
    "grpo.generation.max_logp_difference",
    "grpo.ledger_flush_steps",
    "promotion.block_on_audit",
    "evaluation.cache",
    "evaluation.processes",
    "probe.processes",
    "promotion.metric",
    "promotion.judge",
    "canaries.judge_pairs",
    "canaries.judge_file",
    "canaries.judge_min_ordered",
    "tools",
    *(f"grpo.{name}" for name in GRPOLossSettings.model_fields if name not in ("beta", "loss_type", "scale_rewards")),
    *(f"grpo.{name}" for name in GRPOSteeringSettings.model_fields),
    # 2026-12-06; after "tools" (a section at its default is dropped whole, compared with every key of it)
    "tools.concurrent_calls",
    "evaluation.extractions",
    "data.test_source",
    "data.test_split",
    "data.worked_solution",
)


class PipelineConfig(_Strict):
    name: str = Field(
        "demo", description="The run's name: the registered model's default, the Prefect and MLflow run names."
    )
    output_dir: Path = Field(
        Path("outputs"), description="Where the run writes: each run's folder, the SQLite tracking store, the caches."
    )
    seed: int = Field(
        0, description="Seeds data splitting, training and sampling: same config, seed and threads → the same adapter."
    )
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="math_accuracy"), RewardSpec(name="boxed_format", weight=0.2)],
        description="The reward functions GRPO sums, each with its weight (docs/rewards.md).",
    )
    lora: LoraSettings = LoraSettings()
    sft: SFTSettings = SFTSettings()
    grpo: GRPOSettings = GRPOSettings()
    probe: ProbeSettings = ProbeSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    promotion: PromotionSettings = PromotionSettings()
    tracking: TrackingSettings = TrackingSettings()
    orchestration: OrchestrationSettings = OrchestrationSettings()
    watch: WatchSettings = WatchSettings()
    canaries: CanarySettings = CanarySettings()
    tools: ToolSettings = ToolSettings()
    serving: ServingSettings = ServingSettings()

    @field_validator("rewards")
    @classmethod
    def _at_least_one_reward(cls, rewards: list[RewardSpec]) -> list[RewardSpec]:
        if not rewards:
            raise ValueError("rewards must name at least one reward function")
        return rewards

    @model_validator(mode="after")
    def _batch_holds_whole_groups(self) -> PipelineConfig:
        nodes, processes, grpo = self.orchestration.nodes, self.training_processes(), self.grpo
        world = nodes * processes
        if (grpo.batch_size * world) % grpo.num_generations:
            across = f" × {nodes} nodes" if nodes > 1 else ""
            across += f" × {processes} process{'es' if processes > 1 else ''}" if processes > 1 or nodes > 1 else ""
            across += f" = {grpo.batch_size * world}" if world > 1 else ""
            raise ValueError(
                f"grpo.batch_size ({grpo.batch_size}, per process){across} must be a multiple of "
                f"grpo.num_generations ({grpo.num_generations}): TRL counts completions, and each prompt needs a "
                "whole group"
            )
        return self

    @model_validator(mode="after")
    def _judged_metric_has_a_judge(self) -> PipelineConfig:
        from reward_fns.judges import JUDGES

        promotion = self.promotion
        judges = [spec.name.rsplit(":", 1)[-1] for spec in self.rewards if spec.name in JUDGES]
        if promotion.metric == "judged_win_rate" and not judges:
            raise ValueError(
                "promotion.metric judged_win_rate needs a judge among the rewards (llm_judge, reward_model)"
            )
        if promotion.judge is not None and promotion.judge not in judges:
            raise ValueError(f"promotion.judge {promotion.judge!r} is not one of the judge rewards {judges}")
        return self

    @model_validator(mode="after")
    def _nodes_reach_the_server(self) -> PipelineConfig:
        generation, nodes = self.grpo.generation, self.orchestration.nodes
        server = generation.vllm_mode == "server" and generation.backend != "transformers"
        if nodes > 1 and server and generation.vllm_adapter_dir is None:
            raise ValueError(
                f"orchestration.nodes {nodes} with grpo.generation.vllm_mode server needs "
                "grpo.generation.vllm_adapter_dir: a folder the nodes write each synced adapter to and the "
                "server reads (the default, /dev/shm, is the node's own)"
            )
        return self

    @model_validator(mode="after")
    def _manual_nodes_are_waited_for_with_a_bound(self) -> PipelineConfig:
        orchestration = self.orchestration
        if orchestration.nodes <= 1 or orchestration.launcher != "manual":
            return self
        if orchestration.node_wait_timeout_s is None:
            raise ValueError(
                "orchestration.launcher manual with orchestration.nodes > 1 needs orchestration.node_wait_timeout_s: "
                "nothing else ends the wait for a node that is never started"
            )
        if "rendezvous_host" not in orchestration.model_fields_set:  # an explicit 127.0.0.1 (one machine) is said
            raise ValueError(
                "orchestration.launcher manual with orchestration.nodes > 1 needs orchestration.rendezvous_host: node "
                "0's address the other machines reach (the default, 127.0.0.1, is each machine's own)"
            )
        return self

    @model_validator(mode="after")
    def _a_namespace_for_each_local_node(self) -> PipelineConfig:
        orchestration = self.orchestration
        namespaces = orchestration.local_network_namespaces
        if namespaces and (orchestration.launcher != "local" or len(namespaces) != orchestration.nodes):
            raise ValueError(
                f"orchestration.local_network_namespaces names {len(namespaces)} namespaces: it takes one per node "
                f"(orchestration.nodes {orchestration.nodes}) with orchestration.launcher local "
                f"(not {orchestration.launcher})"
            )
        return self

    @model_validator(mode="after")
    def _node_secrets_have_a_way_to_the_pods(self) -> PipelineConfig:
        orchestration = self.orchestration
        if orchestration.launcher == "kubeflow" and orchestration.env and not orchestration.kubeflow.env_secret:
            raise ValueError(
                "orchestration.env with orchestration.launcher kubeflow needs orchestration.kubeflow.env_secret: the "
                "Secret the pods read them from (values never go into the TrainJob)"
            )
        return self

    @model_validator(mode="after")
    def _tools_on_a_server_from_one_process(self) -> PipelineConfig:
        generation = self.grpo.generation
        server = generation.vllm_mode == "server" and generation.backend != "transformers"
        if self.tools.enabled and server and self.world_size() > 1:
            raise ValueError(
                f"tools.use with grpo.generation.vllm_mode server on {self.world_size()} processes "
                "(orchestration.num_processes × nodes): TRL 1.16's tool loop asks the server for each round's turns "
                "with every rank's rollouts at once and falls out of step when ranks have different numbers still "
                "calling tools (an IndexError or a hang); use vllm_mode colocate, or one process"
            )
        return self

    @model_validator(mode="after")
    def _tools_fit(self) -> PipelineConfig:
        problems = tool_problems(self.tools, self.grpo, self.evaluation)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def world_size(self) -> int:
        """How many processes SFT and GRPO train on in all: ``orchestration.nodes`` × the processes per node.

        >>> PipelineConfig.model_validate({"orchestration": {"nodes": 2, "num_processes": 2}}).world_size()
        4
        """
        return self.orchestration.nodes * self.training_processes()

    def training_processes(self) -> int:
        """How many processes SFT and GRPO train on per node: ``orchestration.num_processes``, else the accelerate
        config file's ``num_processes``, else 1.

        >>> PipelineConfig.model_validate({"orchestration": {"num_processes": 2}}).training_processes()
        2
        """
        orchestration = self.orchestration
        if orchestration.num_processes:
            return orchestration.num_processes
        if orchestration.accelerate_config:
            try:
                from_file = yaml.safe_load(Path(orchestration.accelerate_config).read_text()) or {}
            except (OSError, yaml.YAMLError):
                return 1  # pre-flight names the unreadable file
            if isinstance(from_file, dict) and isinstance(from_file.get("num_processes"), int):
                return max(1, from_file["num_processes"])
        return 1

    def resolved_tracking_uri(self) -> str:
        """The MLflow tracking URI: the configured one, else ``MLFLOW_TRACKING_URI`` (set on the stack's workers),
        else a SQLite file under ``output_dir``."""
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{(self.output_dir.resolve() / 'mlflow.db').as_posix()}"

    def config_hash(self) -> str:
        """A short content hash of everything that changes what a run produces (output paths excluded). Keys added
        after a release count only when set away from their default (``ADDED_LATER``), so an unchanged config keeps
        its hash: Prefect's stage cache and registered versions' ``config_hash`` tags stay valid."""
        payload = self.model_dump(mode="json", exclude={"output_dir", "tracking", "orchestration", "watch", "serving"})
        defaults = PipelineConfig().model_dump(mode="json")
        for dotted in ADDED_LATER:
            *parents, leaf = dotted.split(".")
            node, default = payload, defaults
            for part in parents:
                node, default = node.get(part, {}), default.get(part, {})
            if leaf in node and node[leaf] == default.get(leaf):
                del node[leaf]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
