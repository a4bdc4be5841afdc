"""The engines ``grpoflow serve`` answers with: one base model, the served versions' adapters on it under their own
keys, a chat or plain completion from the adapter a request names.

- ``TransformersEngine``: each version's policy as ``load_policy`` builds it (as ``grpoflow generate`` and the
  evaluation do: fp32 merged exactly, bf16 kept apart from the weights), one request at a time, greedy or sampled
  with grpoflow's own decoding loop. Its greedy answer to a prompt is the one ``grpoflow generate`` gives.
- ``VllmEngine``: vLLM's OpenAI server in its own process on loopback, behind a key only this process knows, with
  two LoRA slots (the old version keeps answering its requests while the new one is checked); adapters loaded and
  unloaded at run time, never merged.
Must not import: Prefect, MLflow, the stages; torch and transformers only inside ``TransformersEngine``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)


class EngineError(InfrastructureError):
    """The engine could not load an adapter or answer a request."""


@dataclass(frozen=True)
class Completion:
    """One answer: its text, why it ended (``stop`` at an end-of-sequence token, ``length`` at ``max_tokens``) and
    the token counts a response's ``usage`` reports."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class ComputeTurns:
    """One generation at a time, in the order asked (no request waits behind later ones); a turn asked with
    ``priority`` (the smoke check of a version about to take traffic) goes before the requests waiting, so a switch
    does not wait behind the queue."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: deque[object] = deque()
        self._busy = False

    @contextlib.contextmanager
    def turn(self, priority: bool = False) -> Iterator[None]:
        ticket = object()
        with self._changed:
            (self._waiting.appendleft if priority else self._waiting.append)(ticket)
            while self._busy or self._waiting[0] is not ticket:
                self._changed.wait()
            self._waiting.popleft()
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()


class Engine(Protocol):
    name: str
    precision: str
    device: str

    def load(self, key: str, adapter_dir: Path) -> None: ...

    def unload(self, key: str) -> None: ...

    def chat(
        self, key: str, messages: list[dict[str, Any]], system_prompt: str | None, **sampling: Any
    ) -> list[Completion]: ...

    def complete(self, key: str, prompt: str, **sampling: Any) -> list[Completion]: ...

    def close(self) -> None: ...


class TransformersEngine:
    """Versions as ``load_policy`` builds them, answered one request at a time (two policies in memory during a
    switch). ``precision`` is the resolved one: ``fp32`` or ``bf16``."""

    name = "transformers"

    def __init__(self, base_dir: Path, precision: str, threads: int | None = None) -> None:
        from tasks.models import load_tokenizer
        from tasks.models.hardware import compute_device

        self.base_dir = Path(base_dir)
        self.precision = precision
        self.device = compute_device()
        self.threads = threads  # torch's compute threads for requests (None: torch's default)
        self.tokenizer = load_tokenizer(self.base_dir)
        self._policies: dict[str, Any] = {}
        self._compute = ComputeTurns()  # one generation at a time: torch already uses every core for one

    def load(self, key: str, adapter_dir: Path) -> None:
        from tasks.models import load_policy

        try:
            self._policies[key] = load_policy(self.base_dir, adapter_dir, precision=self.precision)
        except Exception as exc:  # a malformed adapter (wrong shapes, missing modules) is refused, not served
            raise EngineError(f"the adapter at {adapter_dir} does not load on {self.base_dir}: {exc}") from exc

    def unload(self, key: str) -> None:
        self._policies.pop(key, None)

    def chat(
        self, key: str, messages: list[dict[str, Any]], system_prompt: str | None, **sampling: Any
    ) -> list[Completion]:
        from tasks.inputs import render_prompt

        return self.complete(key, render_prompt(self.tokenizer, messages, system_prompt), **sampling)

    def complete(
        self,
        key: str,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        n: int = 1,
        seed: int = 0,
        threads: int | None = None,
        priority: bool = False,
    ) -> list[Completion]:
        """``threads``: compute on that many threads for this request (the smoke answers use one, so the recording
        and the check add up in the same order whatever the cores); ``priority``: before the requests waiting."""
        import torch

        from tasks.models import generate_completion_ids

        policy = self._policies.get(key)
        if policy is None:
            raise EngineError(f"no adapter {key} is loaded")
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        greedy = temperature <= 0
        with self._compute.turn(priority):
            before, wanted = torch.get_num_threads(), threads or self.threads
            if wanted:
                torch.set_num_threads(wanted)
            try:
                groups = self._generate(
                    generate_completion_ids, policy, prompt_ids, greedy, n, temperature, max_tokens, seed
                )
            finally:
                torch.set_num_threads(before)
        eos = set(_as_list(policy.generation_config.eos_token_id or self.tokenizer.eos_token_id))
        answers = [
            Completion(
                self.tokenizer.decode(ids, skip_special_tokens=True),
                "stop" if ids and ids[-1] in eos else "length",
                len(prompt_ids),
                len(ids),
            )
            for ids in groups[0]
        ]
        return answers * n if greedy else answers  # greedy: n equal answers, decoded once

    def _generate(
        self,
        generate: Any,
        policy: Any,
        prompt_ids: list[int],
        greedy: bool,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
    ) -> list[list[list[int]]]:
        return generate(
            policy,
            self.tokenizer,
            [prompt_ids],
            n=1 if greedy else n,
            greedy=greedy,
            temperature=max(temperature, 1e-5),
            max_new_tokens=max_tokens,
            seed=seed,
            precision=self.precision,
        )

    def close(self) -> None:
        self._policies.clear()


def _as_list(value: Any) -> list[int]:
    return list(value) if isinstance(value, list | tuple) else [] if value is None else [value]


class VllmEngine:
    """vLLM's server in a child process on a free loopback port, with a fresh key: only this process can load
    adapters into it or ask it anything. ``command`` and ``env`` start it (``serving_server_command``)."""

    name = "vllm"

    def __init__(
        self, command: list[str], env: dict[str, str], port: int, precision: str, log_path: Path, on_cpu: bool
    ) -> None:
        import httpx

        from tasks.models import VllmServerClient
        from tasks.models.hardware import compute_device

        self.precision = precision
        self.device = compute_device()
        self.on_cpu = on_cpu  # vLLM's CPU engine dies on a per-request seed (docs/judges.md): none is sent there
        self._key = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                env={**os.environ, **env, "VLLM_API_KEY": self._key},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._admin = VllmServerClient(self.url, api_key=self._key)
        try:
            self._admin.wait_until_up(900, alive=lambda: self._process.poll() is None)
        except Exception as exc:
            self.close()
            raise EngineError(f"vLLM did not start for serving: its log is {log_path}") from exc
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self._key}"}, timeout=httpx.Timeout(600, connect=5)
        )

    def load(self, key: str, adapter_dir: Path) -> None:
        response = self._http.post("/v1/load_lora_adapter", json={"lora_name": key, "lora_path": str(adapter_dir)})
        if response.status_code >= 400:
            raise EngineError(f"vLLM refused the adapter at {adapter_dir}: HTTP {response.status_code} {response.text}")

    def unload(self, key: str) -> None:
        response = self._http.post("/v1/unload_lora_adapter", json={"lora_name": key})
        if response.status_code >= 400:
            logger.warning("vLLM did not unload adapter %s: HTTP %s", key, response.status_code)

    def _sampling(self, max_tokens: int, temperature: float, n: int, seed: int) -> dict[str, Any]:
        return {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "n": n,
            **({} if self.on_cpu else {"seed": seed}),
        }

    def _answers(self, path: str, body: dict[str, Any], chat: bool) -> list[Completion]:
        response = self._http.post(path, json=body)
        if response.status_code >= 400:
            raise EngineError(f"vLLM answered HTTP {response.status_code}: {response.text[:300]}")
        data = response.json()
        usage = data.get("usage") or {}
        choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
        prompt_tokens = int(usage.get("prompt_tokens", 0))
        share = int(usage.get("completion_tokens", 0)) // max(len(choices), 1)
        return [
            Completion(
                (choice["message"]["content"] or "") if chat else choice["text"],
                choice.get("finish_reason") or "stop",
                prompt_tokens,
                share,
            )
            for choice in choices
        ]

    def chat(
        self,
        key: str,
        messages: list[dict[str, Any]],
        system_prompt: str | None,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        n: int = 1,
        seed: int = 0,
        threads: int | None = None,  # vLLM's own threads compute: set at its start
        priority: bool = False,  # vLLM batches every request: nothing waits for a turn
    ) -> list[Completion]:
        from tasks.inputs.loading import prompt_messages

        body = {"model": key, "messages": prompt_messages(messages, system_prompt)}
        return self._answers("/v1/chat/completions", body | self._sampling(max_tokens, temperature, n, seed), True)

    def complete(
        self,
        key: str,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        n: int = 1,
        seed: int = 0,
        threads: int | None = None,
        priority: bool = False,
    ) -> list[Completion]:
        body = {"model": key, "prompt": prompt}
        return self._answers("/v1/completions", body | self._sampling(max_tokens, temperature, n, seed), False)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        http = getattr(self, "_http", None)
        if http is not None:
            http.close()


def start_engine(config: Any, base_dir: Path, engine: str, log_dir: Path) -> Engine:
    """The engine ``serving.engine`` names (``auto``: vLLM where it is installed), at the config's precision."""
    import socket

    import torch

    from tasks.errors import UserError
    from tasks.models import vllm_installed
    from tasks.models.precision import resolved_precision

    precision = resolved_precision(config.model.precision)
    if engine == "auto":
        engine = "vllm" if vllm_installed() else "transformers"
    if engine == "transformers":
        return TransformersEngine(base_dir, precision, config.serving.threads)
    if not vllm_installed():
        from tasks.models.vllm_engine import INSTALL_HINT

        raise UserError(f"serving.engine is vllm, and vLLM is not installed in this Python ({INSTALL_HINT})")
    from tasks.models.sampling import serving_server_command

    with socket.socket() as probe:  # a free loopback port for the engine behind the front
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command, env = serving_server_command(config, base_dir, port)
    on_cpu = not torch.cuda.is_available()
    return VllmEngine(command, env, port, precision, log_dir / f"vllm-{port}.log", on_cpu)
