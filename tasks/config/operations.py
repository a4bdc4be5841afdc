"""How runs are operated: orchestration (retries, processes, nodes and their launchers), tracking, the champion
watch and serving; pydantic models with every default and its description, put together in ``PipelineConfig``.

Owns: those defaults. Must not import: torch, transformers, Prefect, MLflow (loading a config is static).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tasks.config.base import Strict as _Strict

# What orchestration.env may name: the judges' keys (reward_fns.judges.settings.JUDGE_KEY_VARIABLES, the same
# names) and the credentials a node needs to reach MLflow, its artifact store and the Hub. A name, not a value:
# a config that names PATH or LD_PRELOAD would change what runs on every node.
NODE_ENV_VARIABLES = (
    "GRPOFLOW_JUDGE_API_KEY",
    "VLLM_API_KEY",
    "OPENAI_API_KEY",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCESS_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "HF_TOKEN",
    "HF_ENDPOINT",
)


class WatchSettings(_Strict):
    """The champion watch (``grpoflow watch``): re-evaluate ``@champion`` against the champion before it."""

    action: Literal["alert", "rollback"] = Field(
        "alert", description="On a regression: alert (report and emit an event) or rollback (also move champion)."
    )
    include_challenger: bool = Field(False, description="Also evaluate the newest @challenger (reported only).")
    cooldown_h: float = Field(
        6.0, ge=0, description="No automatic move within this many hours of any champion move (still reported)."
    )


class ServingSettings(_Strict):
    """``grpoflow serve``: an OpenAI-compatible endpoint over the base model with the adapter ``alias`` points at,
    following the alias as it moves (docs/serving.md)."""

    alias: str = Field("champion", description="The registry alias whose version is served; a move is followed.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="vllm where it is installed (runtime LoRA, two slots), else grpoflow's transformers engine."
    )
    host: str = Field("127.0.0.1", description="Address to listen on; beyond loopback an API key is required.")
    port: int = Field(8100, ge=1, le=65535, description="The port grpoflow serve listens on.")
    poll_interval_s: float = Field(5.0, gt=0, description="How often the registry's alias is read.")
    smoke_prompts: int = Field(
        3, ge=0, description="Hold-out prompts whose greedy answers a version records at registration (0: none)."
    )
    smoke_max_tokens: int = Field(32, ge=1, description="Tokens of each recorded (and checked) smoke answer.")
    smoke_min_agreement: float = Field(
        0.5,
        ge=0,
        le=1,
        description="On another engine or precision than the recording's: the least mean share of each recorded "
        "answer's characters the served one repeats from its start (the same engine and precision: identical).",
    )
    max_tokens_limit: int = Field(1024, ge=1, description="The most tokens one request may ask for.")
    threads: int | None = Field(
        None, ge=1, description="The transformers engine's compute threads per request (default: torch's, all cores)."
    )


class SlurmSettings(_Strict):
    """``orchestration.launcher: slurm``: the sbatch script the stage writes and submits (open-r1's shape)."""

    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str = Field("24:00:00", description="The job's time limit (sbatch --time).")
    gpus_per_node: int = Field(0, ge=0, description="sbatch --gres=gpu:N; 0 on CPU nodes.")
    one_host: bool = Field(
        False,
        description="Every node on one Slurm host (--nodes=1 --ntasks=N): a one-slurmd harness, not a cluster.",
    )
    extra: list[str] = Field(default_factory=list, description="More #SBATCH lines, e.g. '--qos=high'.")


class KubeflowSettings(_Strict):
    """``orchestration.launcher: kubeflow``: a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1)."""

    image: str = Field("grpoflow-gpu-worker:latest", description="The GPU worker image (infra/docker).")
    namespace: str = Field("default", description="The Kubernetes namespace of the TrainJob.")
    runtime: str = Field("torch-distributed", description="The ClusterTrainingRuntime the TrainJob refers to.")
    gpus_per_node: int = Field(1, ge=0, description="GPUs each node's pod requests.")
    service_account: str | None = Field(None, description="The pods' Kubernetes service account.")
    env_secret: str | None = Field(
        None,
        description="A Kubernetes Secret in the namespace holding orchestration.env's variables (one key per "
        "name); the pods get each as a secretKeyRef, never a value in the TrainJob.",
    )


class OrchestrationSettings(_Strict):
    task_retries: int = Field(0, ge=0, description="Prefect retries per stage; a retried trainer resumes.")
    retry_delay_seconds: int = Field(10, ge=0, description="Seconds between a stage's Prefect retries.")
    min_free_disk_mb: int = Field(1024, ge=0, description="Refuse to start with less free space under output_dir.")
    grpo_deployment: str | None = Field(
        None,
        description="Run GRPO as this Prefect deployment (e.g. 'grpoflow-grpo/grpo-gpu' on a GPU work pool) "
        "instead of in-process; needs a tracking server both workers reach (tracking.tracking_uri).",
    )
    grpo_deployment_timeout_s: float | None = Field(None, gt=0, description="Give up waiting after this long.")
    remote_checkpoints: str | None = Field(
        None,
        description="With grpo_deployment: a folder every GPU worker sees (e.g. a shared mount) for the remote "
        "GRPO's checkpoints; default: the pipeline's MLflow run artifacts (handoff/grpo-checkpoints).",
    )
    num_processes: int | None = Field(
        None,
        ge=1,
        description="Train SFT and GRPO on this many processes per node (accelerate launch; batch sizes stay per "
        "process); wins over accelerate_config's num_processes. Default: the accelerate file's count, else 1.",
    )
    accelerate_config: str | None = Field(
        None, description="An accelerate config file for multi-process training (e.g. infra/accelerate/zero2.yaml)."
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Train SFT and GRPO on this many machines, num_processes on each (torch.distributed, c10d "
        "rendezvous); the nodes share nothing but the MLflow tracking server.",
    )
    launcher: Literal["local", "slurm", "kubeflow", "manual"] = Field(
        "local",
        description="What starts the node agents with nodes > 1: local (processes on this host, each in a "
        "filesystem of its own), slurm (an sbatch job), kubeflow (a TrainJob), manual (prints each node's command).",
    )
    rendezvous_host: str = Field(
        "127.0.0.1",
        description="The address of node 0 every node reaches (accelerate's main_process_ip); Slurm and Kubeflow "
        "set it from the job.",
    )
    rendezvous_port: int = Field(
        29410,
        ge=1024,
        le=65535,
        description="A fixed port on node 0 (port 0 would let every node pick its own); runs side by side need "
        "distinct ports.",
    )
    node_wait_timeout_s: float | None = Field(
        None, gt=0, description="Give up waiting for the nodes after this long (default: wait for the job)."
    )
    node_python: str | None = Field(
        None,
        description="The Python the Slurm nodes run the node agent with (a path on the nodes, or a name on their "
        "PATH); default: this machine's interpreter path. Each node checks it before it starts (Kubeflow's pods use "
        "their image's python).",
    )
    ship_hub_model: bool = Field(
        False,
        description="Send Hub models (the base model, a reward_model's) to the nodes from this machine's cache, as a "
        "local folder is sent (nodes without Hub access); default: each node resolves the Hub id itself (its cache "
        "or the Hub), the base model checked against this machine's bytes.",
    )
    env: list[str] = Field(
        default_factory=list,
        description="Environment variables every node needs (credentials: MLflow, object store, a judge's or "
        "vLLM's key), by name, from an allow-list; values never travel in the request: local nodes inherit them, "
        "Slurm exports them, Kubeflow takes them from kubeflow.env_secret, and each node checks they are set.",
    )
    node_heartbeat_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A node that has beaten (each node agent beats to MLflow every few seconds) and then stays "
        "silent this long is taken as gone (its host or link lost): the stage ends, naming it.",
    )
    collective_timeout_s: float | None = Field(
        None,
        gt=0,
        description="How long a rank waits in one collective (all-reduce, barrier) before it fails (the process "
        "group's timeout, TrainingArguments.ddp_timeout); default: torch's 30 minutes.",
    )
    local_network_namespaces: list[str] = Field(
        default_factory=list,
        description="launcher local: run node K in the K-th of these network namespaces (`ip netns add`, one per "
        "node, each reaching node 0 and the MLflow server, e.g. over a bridge), so the nodes meet over a network "
        "as separate hosts would, not on loopback; set rendezvous_host to node 0's address there.",
    )
    network_interface: str | None = Field(
        None,
        description="The network interface gloo and NCCL use between nodes (GLOO_SOCKET_IFNAME / "
        "NCCL_SOCKET_IFNAME); default: the one that routes to rendezvous_host on each node.",
    )
    slurm: SlurmSettings = SlurmSettings()
    kubeflow: KubeflowSettings = KubeflowSettings()

    @field_validator("env")
    @classmethod
    def _allowed_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in NODE_ENV_VARIABLES:
                raise ValueError(
                    f"{name!r} is not one of the variables nodes may be given: {', '.join(NODE_ENV_VARIABLES)}"
                )
        return names

    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="The one retention policy for SFT's and GRPO's checkpoints: the newest N stay, in the trainer's "
        "folder (TRL's save_total_limit) and in the mirror (remote_checkpoints or the MLflow hand-off). 2 keeps the "
        "one before the newest in case the newest is corrupt.",
    )
    promotion_lock_timeout_s: float = Field(1800, gt=0, description="Wait this long for another run's promotion.")
    promotion_lease_s: float = Field(
        30, gt=1, description="With a tracking server: the promotion lease a killed run leaves expires after this."
    )


class TrackingSettings(_Strict):
    tracking_uri: str | None = Field(None, description="Default: a SQLite store under output_dir.")
    registered_model_name: str = Field(
        "grpoflow-demo", description="The MLflow registered model the adapter is a version of."
    )
    experiment_name: str = Field("grpoflow", description="The MLflow experiment the runs go to.")
    http_retries: int | None = Field(None, ge=0, description="MLflow HTTP retries (default 2; MLflow's own: 7).")
    http_timeout_s: float | None = Field(None, gt=0, description="MLflow HTTP request timeout (default 20 s).")
