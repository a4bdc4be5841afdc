"""One generation component with two engines: probe and evaluation ask a ``PolicySampler`` for completions, and
the pipeline's generation backend decides which engine answers — transformers (grpoflow's decoding loop, or
transformers' own ``generate`` with ``speedups: off``) or vLLM (the in-process engine GRPO's colocate mode shares,
or a vLLM server). Same prompts, same sampling settings (temperature over the whole vocabulary, greedy for
accuracy), same answer shape: ``n`` completion texts per prompt, in prompt order.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tasks.errors import UserError


class PolicySampler(Protocol):
    """What probe and evaluation sample with; ``backend`` names the engine, ``tokenizer`` renders prompts."""

    backend: str
    tokenizer: Any

    def sample(
        self,
        prompts: Sequence[str],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_new_tokens: int = 32,
        seed: int = 0,
        greedy: bool = False,
        progress: Callable[[int, int], None] | None = None,
        stats: Any = None,
    ) -> list[list[str]]: ...


class TransformersSampler:
    """The transformers engine: ``generate_completions`` on a loaded policy (kept as ``model``, which evaluation's
    forgetting check scores with as well)."""

    backend = "transformers"

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, precision: str, stock: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.precision = precision
        self.stock = stock

    def sample(self, prompts: Sequence[str], **settings: Any) -> list[list[str]]:
        """``generate_completions`` with this sampler's batch size, precision and engine choice."""
        from tasks.models.generation import generate_completions

        return generate_completions(
            self.model,
            self.tokenizer,
            prompts,
            batch_size=self.batch_size,
            precision=self.precision,
            stock=self.stock,
            **settings,
        )

    def prompt_of(self, row: dict[str, Any], system_prompt: str | None) -> str:
        """What this engine samples for a row: its prompt rendered by the chat template (``render_prompt``)."""
        from tasks.inputs import render_prompt

        return render_prompt(self.tokenizer, row["prompt"], system_prompt)

    def sample_ids(self, prompt_ids: Sequence[Sequence[int]], **settings: Any) -> list[list[list[int]]]:
        """``sample`` on token ids (``generate_completion_ids``): what grpoflow's tool loop extends."""
        from tasks.models.generation import generate_completion_ids

        return generate_completion_ids(
            self.model,
            self.tokenizer,
            prompt_ids,
            batch_size=self.batch_size,
            precision=self.precision,
            stock=self.stock,
            **settings,
        )

    def sample_with_greedy(self, prompts: Sequence[str], **settings: Any) -> tuple[list[list[str]], list[list[str]]]:
        """Each prompt's greedy completion and its ``n`` samples, decoded together from one prefill (what
        evaluation asks for); the samples are those ``sample`` draws with the same settings."""
        both = self.sample(prompts, greedy_first=True, **settings)
        return [each[:1] for each in both], [each[1:] for each in both]


def resolve_backend(backend: str, mode: str = "colocate", cuda: bool | None = None, vllm: bool | None = None) -> str:
    """The generation backend a pipeline runs: ``auto`` is vLLM where CUDA and vLLM are both here (on a CPU
    grpoflow's own loop is faster: ``bench/bench_vllm.py``) or when a server is configured; ``vllm`` is honoured on
    any device once vLLM is installed (server mode needs no vLLM in this process).

    >>> resolve_backend("auto", cuda=True, vllm=True), resolve_backend("auto", cuda=False, vllm=True)
    ('vllm', 'transformers')
    >>> resolve_backend("vllm", cuda=False, vllm=True), resolve_backend("vllm", "server", cuda=False, vllm=False)
    ('vllm', 'vllm')
    """
    import torch

    from tasks.models.vllm_engine import INSTALL_HINT, vllm_installed

    cuda = torch.cuda.is_available() if cuda is None else cuda
    vllm = vllm_installed() if vllm is None else vllm
    if backend == "transformers":
        return "transformers"
    if mode == "server":
        return "vllm"
    if backend == "vllm" and not vllm:
        raise UserError(
            f"grpo.generation.backend is 'vllm' but vLLM is not installed here: {INSTALL_HINT}, "
            "or set grpo.generation.backend to auto"
        )
    return "vllm" if backend == "vllm" or (cuda and vllm) else "transformers"


def engine_name(backend: str, mode: str) -> str:
    """The one name of an engine in tags, params, the ledger, summaries and docs: ``transformers``,
    ``vllm-colocate`` or ``vllm-server``.

    >>> engine_name("transformers", "server"), engine_name("vllm", "colocate"), engine_name("vllm", "server")
    ('transformers', 'vllm-colocate', 'vllm-server')
    """
    return "transformers" if backend == "transformers" else f"vllm-{mode}"


def pipeline_engine(config: Any) -> str:
    """``engine_name`` of the engine a pipeline config samples with."""
    return engine_name(pipeline_backend(config), config.grpo.generation.vllm_mode)


def pipeline_backend(config: Any) -> str:
    """``resolve_backend`` for a pipeline config's ``grpo.generation``."""
    generation = config.grpo.generation
    return resolve_backend(generation.backend, generation.vllm_mode)


def samples_on_cpu(config: Any) -> bool:
    """Whether a pipeline's models sample with transformers on the CPU (no CUDA, no vLLM engine): what may be
    forked into a second process."""
    import torch

    return pipeline_backend(config) == "transformers" and not torch.cuda.is_available()


def pipeline_engine_spec(config: Any, base_model_dir: Path) -> Any:
    """The in-process vLLM engine a pipeline uses (one spec per config, so its stages share one engine)."""
    import torch

    from tasks.models.precision import resolve_dtype
    from tasks.models.vllm_engine import engine_spec

    generation, grpo = config.grpo.generation, config.grpo
    max_num_seqs = max(grpo.batch_size * grpo.steps_per_generation, 64)
    return engine_spec(
        base_model_dir,
        precision_dtype="bfloat16" if resolve_dtype(config.model.precision) == torch.bfloat16 else "float32",
        lora_rank=config.lora.r,
        max_model_len=generation.vllm_max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=generation.vllm_gpu_memory_utilization,
        kv_cache_gib=generation.vllm_kv_cache_gib,
        seed=config.seed,
        cuda=torch.cuda.is_available(),
        log_file=vllm_log_file(config),
    )


def vllm_log_file(config: Any) -> Path:
    """Where the in-process vLLM engine's own log lines go (every stage's and rank's, appended).

    >>> from tasks.config import PipelineConfig
    >>> vllm_log_file(PipelineConfig(output_dir="outputs/demo")).as_posix()
    'outputs/demo/logs/vllm.log'
    """
    return Path(config.output_dir) / "logs" / "vllm.log"


def policy_sampler(
    config: Any, base_model_dir: Path, adapter_dir: Path | None, batch_size: int, model: Any = None
) -> PolicySampler:
    """The sampler the pipeline's backend gives for a base model and an adapter (or none). ``model``: that policy,
    already loaded, for the transformers engine (loaded here when None). With ``tools``, the engine's sampler inside
    a ``ToolSampler`` (its ``without_tools`` is the engine's alone, rendering with the same template)."""
    inner = engine_sampler(config, base_model_dir, adapter_dir, batch_size, model)
    if not config.tools.enabled:
        return inner
    from tasks.models.tool_rollouts import tool_sampler

    if inner.backend == "transformers":
        context = int(getattr(inner.model.config, "max_position_embeddings", 0) or 1 << 20)
    else:
        context = config.grpo.generation.vllm_max_model_len
    return tool_sampler(inner, config, context)


def engine_sampler(
    config: Any, base_model_dir: Path, adapter_dir: Path | None, batch_size: int, model: Any = None
) -> Any:
    """The backend's own sampler (``policy_sampler`` without the tools)."""
    from tasks.models.loading import load_policy, load_tokenizer

    tokenizer = load_tokenizer(base_model_dir)
    if pipeline_backend(config) == "vllm":
        generation = config.grpo.generation
        if generation.vllm_mode == "server":
            from tasks.models.vllm_server import ServerSampler, VllmServerClient

            client = VllmServerClient(generation.vllm_server_base_url, timeout_s=generation.vllm_server_timeout_s)
            client.check()
            return ServerSampler(client, tokenizer, adapter_dir, generation.vllm_adapter_dir)
        from tasks.models.vllm_engine import VllmSampler, shared_engine

        return VllmSampler(shared_engine(pipeline_engine_spec(config, base_model_dir)), tokenizer, adapter_dir)
    from tasks.speedups import speedups_on

    if model is None:
        model = load_policy(base_model_dir, adapter_dir, precision=config.model.precision)
    stock = not speedups_on(config.grpo.speedups)
    return TransformersSampler(model, tokenizer, batch_size, config.model.precision, stock)


def pipeline_server_command(
    config: Any, base_model_dir: Path, host: str, port: int
) -> tuple[list[str], dict[str, str]]:
    """The command (and the environment it adds) that serves this pipeline's base model with vLLM for server
    mode: the same dtype, LoRA rank, context length and KV-cache size as the in-process engine, adapters loaded at
    run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    command, env, _ = _served(config, base_model_dir, host, port, lora=True)
    return command, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **env}


def serving_server_command(config: Any, base_model_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The vLLM server behind ``grpoflow serve``: the pipeline's dtype and LoRA rank, on loopback (grpoflow's own
    front answers clients), two adapter slots so a version switch keeps the old adapter until its requests end."""
    command, env, _ = _served(config, base_model_dir, "127.0.0.1", port, lora=True, max_loras=2)
    return command, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **env}


def judge_server_command(
    config: Any, judge_model_dir: Path, host: str, port: int, served_name: str = "judge"
) -> tuple[list[str], dict[str, str], bool]:
    """The command that serves ``judge_model_dir`` as an LLM judge (``grpoflow vllm-serve --judge``): no LoRA, the
    pipeline's dtype and, on a CPU, a KV cache sized for the judge's own prompts (``vllm_max_model_len``); the
    environment it adds; whether it runs on a CPU (where vLLM's engine dies on a per-request seed)."""
    return _served(config, judge_model_dir, host, port, lora=False, served_name=served_name)


def _served(
    config: Any, model_dir: Path, host: str, port: int, lora: bool, **options: Any
) -> tuple[list[str], dict[str, str], bool]:
    """vLLM's server command for ``model_dir`` with the pipeline engine's dtype, context length and KV cache, the
    environment it adds, and whether it runs on a CPU."""
    from tasks.models.vllm_server import server_command

    spec = pipeline_engine_spec(config, model_dir)
    command = server_command(
        model_dir,
        host=host,
        port=port,
        dtype=spec.dtype,
        max_lora_rank=spec.max_lora_rank,
        max_model_len=spec.max_model_len,
        kv_cache_bytes=spec.kv_cache_bytes,
        gpu_memory_utilization=None if spec.kv_cache_bytes else spec.gpu_memory_utilization,
        lora=lora,
        **options,
    )
    # The server's own process logs as vLLM does (to its output, which vllm-serve keeps in a file).
    env = {"VLLM_CONFIGURE_LOGGING": "1"}
    on_cpu = spec.kv_cache_bytes is not None
    if on_cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU default keeps a core for its scheduler (one of two here); bound to every core this process
        # may use, the model computes on all of them (bench/bench_server_cores.py: +33 % tokens/s on two cores).
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(os.sched_getaffinity(0))
    return command, env, on_cpu


def cpu_list(cpus: set[int]) -> str:
    """CPU ids as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` takes them: ranges joined by commas.

    >>> cpu_list({0, 1}), cpu_list({0, 2, 3, 4, 7})
    ('0-1', '0,2-4,7')
    """
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
