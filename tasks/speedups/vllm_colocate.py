"""GRPO through vLLM with an adapter-only weight sync, for TRL's colocate and server modes (TRL 1.16, vLLM 0.31).

TRL's own sync merges the LoRA adapter into the policy, pushes every weight into vLLM and unmerges: on a CPU it
fails at the first sync (vLLM's CPU layers prepack their weights and drop the originals, so ``load_weights`` has
nothing to load into), it moves the whole model each step, and in bf16 the merge/unmerge round trip drifts the
base weights (trl issue 6688). Here the adapter alone goes to vLLM: after each optimizer step it is saved to a new
folder (under ``/dev/shm`` where there is one) and handed to the engine as a new ``LoRARequest`` (colocate) or
loaded into the server under a new name (server); every generation request names it. Megabytes instead of the
model, the same code on a CPU and a GPU, and the base weights vLLM holds never change.

TRL builds its ``VLLMGeneration`` inside ``GRPOTrainer.__init__`` from a module-level name; ``VllmAdapterSync``
swaps that name for ``AdapterVLLMGeneration`` while the trainer is built (a private seam: checked on TRL 1.16,
refused with a clear error on a TRL without it). Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.models import EngineSpec, VllmServerClient, adapter_digest, adapter_request, rank_engine, shared_engine

logger = logging.getLogger(__name__)


@dataclass
class VllmSetup:
    """How GRPO reaches vLLM: the in-process engine's spec (colocate) or a server's URL (server)."""

    mode: str  # "colocate" | "server"
    engine: EngineSpec | None = None
    server_url: str | None = None
    server_timeout_s: float = 300.0
    sync_root: Path | None = None  # where synced adapters are written (grpo.generation.vllm_adapter_dir)


@dataclass
class SyncRecord:
    """One adapter sync: the optimizer step whose weights it carries, what was written, how long it took."""

    step: int
    name: str
    digest: str
    bytes: int
    seconds: float


@dataclass
class GenerationRecord:
    """What generated GRPO's completions: the backend and mode, batches, and every adapter sync."""

    backend: str = "transformers"
    mode: str | None = None
    batches: int = 0
    completions: int = 0
    syncs: list[SyncRecord] = field(default_factory=list)

    @property
    def engine(self) -> str:
        """The engine's name in grpoflow's one vocabulary (``tasks.models.engine_name``).

        >>> GenerationRecord().engine, GenerationRecord("vllm", "server").engine
        ('transformers', 'vllm-server')
        """
        from tasks.models import engine_name

        return engine_name(self.backend, self.mode or "colocate")

    def describe(self) -> str:
        """One line for the log and the stage run, e.g. ``vllm-colocate: 4 batches, 32 completions; ...``."""
        if self.backend != "vllm":
            return f"transformers: {self.batches} batches, {self.completions} completions"
        sync = ""
        if self.syncs:
            seconds = sum(s.seconds for s in self.syncs) / len(self.syncs)
            sync = f"; {len(self.syncs)} adapter syncs of {self.syncs[-1].bytes / 2**20:.1f} MB, {seconds:.2f} s each"
        return f"{self.engine}: {self.batches} batches, {self.completions} completions{sync}"


def _sync_root(setup: VllmSetup) -> Path:
    """A new folder for this run's synced adapters: under ``sync_root`` (a path the server reads, on GPU hosts),
    else ``/dev/shm`` (memory, where there is one), else the temp folder."""
    from tasks.models.vllm_server import handover_root

    base = handover_root(setup.sync_root)
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="grpoflow-lora-", dir=base))


@functools.cache
def _vllm_generation_class() -> type:
    """``AdapterVLLMGeneration``, defined on first use: TRL's ``VLLMGeneration`` imports vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration

    class AdapterVLLMGeneration(VLLMGeneration):
        """TRL's vLLM generation with grpoflow's engine (LoRA on, the pipeline's dtype and KV-cache size) or
        server client, and an adapter-only ``sync_weights``."""

        def __init__(self, *args: Any, setup: VllmSetup, record: GenerationRecord, **kwargs: Any) -> None:
            self.setup = setup
            self.record = record
            self.record.backend, self.record.mode = "vllm", setup.mode
            self.current_step = 0
            self._lora = None
            self._folders: list[Path] = []
            self._root = _sync_root(setup)
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            if self.mode == "server":  # rank 0 alone talks to the server, as in TRL
                self.vllm_client = None
                if self.accelerator.is_main_process:
                    url, timeout = self.setup.server_url or "", self.setup.server_timeout_s
                    self.vllm_client = VllmServerClient(url, timeout_s=timeout)
                    self.vllm_client.check()  # one clear error before training starts
            else:
                assert self.setup.engine is not None
                spec = rank_engine(self.setup.engine, self.accelerator.process_index)  # a seed of its own per rank
                self.llm = _WithAdapter(shared_engine(spec), self, spec.seed)
            self.accelerator.wait_for_everyone()

        def sync_weights(self) -> None:
            """The trainer's adapter after the last optimizer step, handed to vLLM as a new adapter."""
            started = time.perf_counter()
            if self.mode == "server" and self.vllm_client is None:  # another rank: rank 0 hands the adapter over
                self.accelerator.wait_for_everyone()
                return
            policy = self.accelerator.unwrap_model(self.model)
            if not hasattr(policy, "peft_config"):
                raise TypeError("grpoflow's vLLM sync sends a LoRA adapter; the policy has none")
            number = len(self.record.syncs) + 1
            folder = self._root / f"sync-{number:05d}"
            policy.save_pretrained(str(folder))
            name = f"{self._root.name}-step-{self.current_step}-sync-{number}"  # unique on a shared server
            if self.mode == "server":
                self.vllm_client.load_adapter(name, folder)
            else:
                self._lora = adapter_request(folder, name)
            self._folders.append(folder)
            while len(self._folders) > 2:  # vLLM reads a folder at the first request that names it
                shutil.rmtree(self._folders.pop(0), ignore_errors=True)
            size = sum(f.stat().st_size for f in folder.iterdir())
            record = SyncRecord(self.current_step, name, adapter_digest(folder), size, time.perf_counter() - started)
            self.record.syncs.append(record)
            logger.debug(
                "adapter sync %d: step %d, %d bytes in %.3f s, sha256 %s",
                number,
                record.step,
                size,
                record.seconds,
                record.digest,
            )
            if self.mode == "server":
                self.accelerator.wait_for_everyone()

        def generate(self, prompts: list, images: Any, num_generations: int, profiler: Any = None) -> tuple:
            result = super().generate(prompts, images, num_generations, profiler)
            self.record.batches += 1
            self.record.completions += len(result[1])
            return result

        def close(self) -> None:
            """Remove the synced adapters' folder and, on a server, the last adapter loaded (best effort)."""
            if self.mode == "server" and self.vllm_client is not None:
                with contextlib.suppress(Exception):
                    self.vllm_client.unload_adapters()
            shutil.rmtree(self._root, ignore_errors=True)

    return AdapterVLLMGeneration


class _WithAdapter:
    """The shared engine, as TRL's colocate generation sees it: every ``generate`` names the synced adapter.

    On a CPU, vLLM's sampler draws from torch's global generator (it refuses per-request seeds), which every rank
    seeded alike: each call draws instead from a generator forked and seeded from the rank's engine seed and the
    call's number, so ranks draw apart, runs repeat, and training's own random stream is left as it was. On a GPU
    vLLM's own generator, seeded per engine, draws."""

    def __init__(self, llm: Any, owner: Any, seed: int) -> None:
        import torch

        self._llm = llm
        self._owner = owner
        self._seed = None if torch.cuda.is_available() else seed
        self._calls = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        kwargs.setdefault("lora_request", self._owner._lora)
        if self._seed is None:
            return self._llm.generate(*args, **kwargs)
        self._calls += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed * 1_000_003 + self._calls)
            return self._llm.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


class VllmAdapterSync:
    """Trainer mixin: GRPO through vLLM with the adapter-only sync (``vllm_setup``), and a record of what
    generated (``generation_record``). Without ``vllm_setup`` it changes nothing."""

    def __init__(self, *args: Any, vllm_setup: VllmSetup | None = None, **kwargs: Any) -> None:
        self.generation_record = GenerationRecord()
        if vllm_setup is None:
            super().__init__(*args, **kwargs)
            return
        import trl.trainer.grpo_trainer as grpo_module

        if not hasattr(grpo_module, "VLLMGeneration"):
            import trl

            raise RuntimeError(
                f"TRL {trl.__version__} builds its vLLM generation differently from TRL 1.16, which "
                "grpoflow's adapter-only vLLM sync was written for: use the lock's TRL"
            )
        original = grpo_module.VLLMGeneration
        grpo_module.VLLMGeneration = functools.partial(
            _vllm_generation_class(), setup=vllm_setup, record=self.generation_record
        )
        try:
            super().__init__(*args, **kwargs)
        finally:
            grpo_module.VLLMGeneration = original

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):  # noqa: ANN001, ANN202
        generation = getattr(self, "vllm_generation", None)
        if generation is not None:
            generation.current_step = self.state.global_step  # the step a sync made now carries
        else:
            self.generation_record.batches += 1
            self.generation_record.completions += len(prompt_ids)
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
