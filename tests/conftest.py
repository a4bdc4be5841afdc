"""Shared fixtures: the tiny model (built once, locally), a temp output dir with its own MLflow store, and an
isolated Prefect home, so tests run offline and leave nothing behind."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# One folder holds every temporary file of a test run, its workers' and their subprocesses' (TMPDIR is inherited):
# the process that made it removes it when it exits, so a run leaves nothing behind, even where a test kills a
# process before it can clean up. pytest's own tmp_path folders stay where pytest keeps them (its last three runs).
if "GRPOFLOW_TEST_TMP" not in os.environ:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ["GRPOFLOW_TEST_TMP"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="grpoflow-tests-")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, os.environ["GRPOFLOW_TEST_TMP"], ignore_errors=True)
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="session-"))
# `make test` runs the suite on pytest-xdist workers (a session dir and Prefect home each; the grpoflow cache is
# the first process's, shared). Each computes on its share of the cores: torch's OpenMP threads spin while they
# wait, so two workers of two threads on two cores ran many times slower than one. The tests' own subprocesses
# (CLI runs, ranks, servers) inherit the setting.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
# Before Prefect, MLflow or transformers are imported anywhere (importing ``tasks`` itself sets the telemetry-off
# defaults, below these).
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "PREFECT_HOME": str(_SESSION_DIR / "prefect"),
        # Prefect 3.7 keeps task results (the stage cache) in ~/.prefect/storage whatever PREFECT_HOME says.
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(_SESSION_DIR / "prefect" / "storage"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        # Prefect's console handler logs "stopping temporary server" after pytest closed its streams.
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
)
os.environ.setdefault("GRPOFLOW_CACHE", str(_SESSION_DIR / "cache"))
for _outside in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):  # tests start their own servers or stores
    os.environ.pop(_outside, None)

import pytest  # noqa: E402

from tasks.config import PipelineConfig, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# tests/vllm needs vLLM, which `make test` does not install: `make test-vllm` runs it in its own venv.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
# tests/nodes trains on two nodes for minutes: `make test-nodes` runs it.
if not os.environ.get("GRPOFLOW_TEST_NODES"):
    collect_ignore.append("nodes")


@contextlib.contextmanager
def machine_share(folder: Path, alone: bool) -> Iterator[None]:
    """A share of the machine among the workers of one parallel run: every test holds the room shared, a test
    marked ``alone`` holds it alone. A waiting ``alone`` test first takes the turnstile, so no worker starts another
    test while it waits (flock readers would otherwise starve it). Locks die with their process."""
    with open(folder / "turnstile", "a") as turnstile, open(folder / "room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _machine(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` (one that measures behaviour under a load it makes itself) runs
    while every other worker waits; elsewhere this does nothing."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if _WORKERS <= 1 or not run:
        yield
        return
    folder = Path(os.environ["GRPOFLOW_TEST_TMP"]) / f"machine-{run}"
    folder.mkdir(exist_ok=True)
    alone = request.node.get_closest_marker("alone") is not None
    with machine_share(folder, alone):
        if not alone:
            yield
            return
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or threads)  # the machine is its own: every core
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long work first (grouped tests, the flows), so the workers of a parallel run finish together; tests that
    want the machine alone last, when the other worker is on short tests or done (first, such a test waited for
    nothing but paid its worker's cold start while the other worker idled: 59 s instead of 36)."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("alone"):
            return 2
        return 0 if item.get_closest_marker("xdist_group") or "tests/flows/" in item.nodeid else 1

    items.sort(key=rank)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from tasks.models import TINY_RANDOM, resolve_model_source

    return resolve_model_source(TINY_RANDOM)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sequence-classification reward model (one label) on the tiny model's body and tokenizer, random head,
    built once: what a user's reward model folder holds."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("reward-model")
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_config(tmp_path: Path) -> PipelineConfig:
    """configs/tiny.yaml with its outputs (and so its SQLite MLflow store) in a temp dir."""
    return load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(tmp_path / "outputs")})


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory: pytest.TempPathFactory):
    """The tiny config's validated train / hold-out files, made once."""
    from tasks.validate import run_validate

    config = load_config(REPO / "configs" / "tiny.yaml")
    return run_validate(config, tmp_path_factory.mktemp("split"))


@pytest.fixture
def tiny_adapter(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A freshly initialised LoRA adapter over the tiny model, saved the way the trainers save theirs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tasks.models import load_base_model

    torch.manual_seed(0)
    model = get_peft_model(load_base_model(tiny_model_dir), LoraConfig(r=2, target_modules="all-linear"))
    with torch.no_grad():  # LoRA B starts at zero; make the adapter change the outputs
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


@pytest.fixture
def lora_adapter(tiny_model_dir: Path):
    """Builds LoRA adapters over the tiny model: ``lora_adapter(folder, noise)``. noise 0: untrained (the base
    model's behaviour); noise 1: random weights on the output layer, which raise general-text perplexity about
    fourfold (the tiny model's tied output layer is near zero, so damage below it would not show)."""

    def build(folder: Path, noise: float) -> Path:
        import torch
        from peft import LoraConfig, get_peft_model

        from tasks.models import load_base_model

        torch.manual_seed(1)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"])
        model = get_peft_model(load_base_model(tiny_model_dir), lora)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, noise) if noise else parameter.zero_()
        model.save_pretrained(folder)
        return folder

    return build


@pytest.fixture
def make_scores():
    """Build evaluation scores from per-prompt sampled pass@1 values (n = 4 samples per prompt)."""
    import numpy as np

    from tasks.evaluate import ModelScores
    from tasks.evaluation import pass_at_k

    def scores(name: str, per_prompt: list[float], n: int = 4) -> ModelScores:
        counts = [round(p * n) for p in per_prompt]
        return ModelScores(
            name=name,
            n_prompts=len(per_prompt),
            n_samples=n,
            greedy_accuracy=float(np.mean(per_prompt)),
            pass_at_k={k: float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in (1, 2, 4)},
            pass1_interval=(0.0, 1.0),
            per_prompt_pass1=per_prompt,
            per_prompt_greedy=per_prompt,
        )

    return scores


@pytest.fixture
def lock_holder():
    """Start a process that is inside promotion: it holds the promotion lock of ``locked-model`` (a 3 s lease on
    a tracking server) until it is killed; returns it once it holds the lock."""
    import subprocess
    import sys

    script = (
        "import sys, time\nfrom tasks.registry.locks import promotion_lock\n"
        "with promotion_lock(sys.argv[1], 'locked-model', lease_s=3):\n"
        "    print('locked', flush=True)\n    time.sleep(600)\n"
    )
    started = []

    def start(tracking_uri: str) -> subprocess.Popen:
        holder = subprocess.Popen(
            [sys.executable, "-c", script, tracking_uri],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(holder)
        assert holder.stdout.readline().strip() == "locked"
        return holder

    yield start
    for holder in started:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.fixture(scope="session")
def registered_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineConfig, dict]:
    """The tiny pipeline run once through the real flow (registering version 1 of its model and of the SFT
    backup); the tests that need a registered model share it."""
    from flows.pipeline import pipeline

    output = tmp_path_factory.mktemp("registered") / "outputs"
    # With the hold-out scored at every GRPO step and the best checkpoint handed on (docs/steering.md).
    steering = {"grpo.eval_steps": 1, "grpo.eval_prompts": 8, "grpo.select": "best"}
    config = load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(output), **steering})
    return config, pipeline(config, "tiny-e2e-1")


# Registered versions made the way promote makes them (packaged as an MLflow model with its adapter digest and smoke
# record), from adapters a test builds: what `grpoflow serve` follows (tests/flows/test_serve.py, tests/vllm).
SERVE_PROMPTS = ("What is 2+3?", "What is 7*6?", "Name a prime number.")


@pytest.fixture(scope="session")
def register_version(tmp_path_factory: pytest.TempPathFactory):
    """``register_version(config, seed, smoke_answers=None, corrupt=False)``: a version of the config's registered
    model holding ``random_adapter(seed)``, packaged as promote packages one (``save_version_model``, the digest tag,
    ``record_smoke`` on the smoke prompts); ``smoke_answers`` replaces the recorded answers (a version that fails
    its smoke check), ``corrupt`` flips bytes of the stored adapter after registration (a digest mismatch)."""
    import json

    from tasks.models import resolve_model_source
    from tasks.models.precision import resolved_precision
    from tasks.registry import client_for
    from tasks.serving import SMOKE_FILE, TransformersEngine, random_adapter, register_served_version

    root = tmp_path_factory.mktemp("versions")
    engines: dict[tuple[Path, str], TransformersEngine] = {}

    def register(config: PipelineConfig, seed: int, smoke_answers: list[str] | None = None, corrupt: bool = False):
        base_dir = resolve_model_source(config.model.source)
        precision = resolved_precision(config.model.precision)
        engine = engines.setdefault((base_dir, precision), TransformersEngine(base_dir, precision))
        adapter = random_adapter(base_dir, root / f"adapter-{seed}", seed)
        folder = root / f"model-{seed}-{len(list(root.iterdir()))}"
        version, run_id = register_served_version(config, adapter, list(SERVE_PROMPTS), engine, folder)
        stored = Path(
            client_for(config.resolved_tracking_uri()).get_run(run_id).info.artifact_uri.removeprefix("file://")
        )
        if smoke_answers:  # the stored record changes: the version no longer answers as it says
            record = json.loads((stored / "model" / SMOKE_FILE).read_text())
            (stored / "model" / SMOKE_FILE).write_text(json.dumps(record | {"answers": smoke_answers}))
        if corrupt:  # the stored weights change after registration, as a damaged or replaced object would
            weights = stored / "model/artifacts/adapter/adapter_model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-64:] = bytes(64)
            weights.write_bytes(bytes(data))
        return version

    return register


def http_post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any], dict[str, str]]:
    """POST ``body`` as JSON; the status, the JSON answer and the headers (lower-case names)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), {k.lower(): v for k, v in exc.headers.items()}


def http_get(url: str) -> tuple[int, str]:
    """GET ``url``: the status (0 when nothing answers) and the text."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - started


class ServeClients:
    """``count`` threads sending greedy chat requests to ``grpoflow serve`` in a loop, each result kept as
    (prompt, status, answer, headers); a refused or dropped connection is a failed request (status -1)."""

    def __init__(self, url: str, count: int, max_tokens: int) -> None:
        self.url, self.max_tokens, self.results, self.stop = url, max_tokens, [], threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(count)]

    def loop(self, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            prompt = SERVE_PROMPTS[turn % len(SERVE_PROMPTS)]
            messages = [{"role": "user", "content": prompt}]
            body = {"messages": messages, "temperature": 0, "max_tokens": self.max_tokens}
            try:
                status, answer, headers = http_post(f"{self.url}/v1/chat/completions", body)
            except OSError as exc:
                status, answer, headers = -1, {"error": str(exc)}, {}
            self.results.append((prompt, status, answer, headers))
            turn += 1

    def seen(self, version: str) -> bool:
        """Whether the latest answers came from ``version``."""
        return any(r[2].get("grpoflow", {}).get("version") == version for r in self.results[-8:])

    def __enter__(self) -> ServeClients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


@dataclass
class ServeHarness:
    """``grpoflow serve`` as a user starts it (the real command, its own process group), and clients to load it."""

    post: Callable[..., Any] = staticmethod(http_post)
    get: Callable[..., Any] = staticmethod(http_get)
    wait_for: Callable[..., float] = staticmethod(wait_for)
    clients: type = ServeClients
    prompts: tuple[str, ...] = SERVE_PROMPTS

    @staticmethod
    def start(config_args: list[str], log: Path, port: int, timeout: float = 180) -> Any:
        """Start ``grpoflow serve`` with ``config_args`` on ``port``; returns the process once /health says 200."""
        import subprocess
        import sys

        command = [sys.executable, "-m", "flows.cli", "serve", *config_args, "--port", str(port)]
        with log.open("w") as out:
            server = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(f"{url}/health")[0] == 200 or server.poll() is not None, timeout, "serve answering")
        assert server.poll() is None, log.read_text()[-3000:]
        return server


@pytest.fixture
def serve_harness() -> ServeHarness:
    return ServeHarness()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``mlflow server`` on 127.0.0.1 for the module (SQLite store, artifacts proxied through it, so a
    client needs nothing but its address); stopped, with its workers, after the module."""
    from flows.services import free_port

    with running_mlflow_server(tmp_path_factory.mktemp("mlflow-server"), "127.0.0.1", free_port()) as server:
        yield server


@contextlib.contextmanager
def running_mlflow_server(root: Path, host: str, port: int) -> Iterator[dict[str, Any]]:
    """An ``mlflow server`` on ``host:port`` over a new store under ``root`` while the block runs."""
    import subprocess
    import sys
    import time
    import urllib.request

    from flows.services import stop_group

    command = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"]
    # Its own process group: the server forks a uvicorn worker that must go with it.
    server = subprocess.Popen(
        command,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not become healthy in 90 s") from None
                time.sleep(0.5)
        yield {"uri": f"http://{host}:{port}", "root": root, "port": port, "process": server}
    finally:
        stop_group(server)


# An OpenAI-compatible endpoint on loopback whose behaviour a test sets: a judge that answers by a rule, is down,
# slow, flaky or answers garbage. It stands in for a remote judge's failure modes (a real vLLM server judges in
# tests/vllm); every request is counted and kept.


def rule_judge(payload: dict[str, Any]) -> str:
    """Pointwise: 10 when the response holds the reference answer, 2 otherwise; pairwise: the response that says
    "good" (else the one that does not say "poor") wins, whichever position it is in."""
    text = payload["messages"][-1]["content"]
    if "Response A:" in text:
        first, second = text.split("Response A:", 1)[1].split("Response B:", 1)
        second = second.split("Which response", 1)[0]

        def merit(response: str) -> int:
            return 2 * ("good" in response) - ("poor" in response)

        return "A" if merit(first) > merit(second) else "B"
    reference = re.search(r"Reference answer:\n(.*)\n", text)
    response = text.split("Response:\n", 1)[1].split("\n\nGive the response", 1)[0]
    return "10" if reference and reference[1].strip() in response else "2"


@dataclass
class JudgeServer:
    url: str
    answer: Callable[[dict[str, Any]], str] = rule_judge
    mode: str = "ok"  # ok | slow | garbage | flaky | html
    delay_s: float = 0.0
    failures_left: int = 0
    api_key: str | None = None  # when set, a request without ``Authorization: Bearer <api_key>`` gets a 401
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    state = JudgeServer(url="")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if state.api_key and self.headers.get("Authorization") != f"Bearer {state.api_key}":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with state.lock:
                state.requests.append(payload)
                flaky = state.mode == "flaky" and state.failures_left > 0
                state.failures_left -= flaky
            if state.mode == "slow":
                time.sleep(state.delay_s)
            if flaky:
                self.send_response(503)
                self.end_headers()
                return
            if state.mode == "html":
                body = b"<html>not an API</html>"
            else:
                content = "the score is high" if state.mode == "garbage" else state.answer(payload)
                choice: dict[str, Any] = {"message": {"role": "assistant", "content": content}}
                if payload.get("logprobs"):  # the answer at 0.75, the allowed choice farthest from it at 0.25
                    allowed = (payload.get("structured_outputs") or {}).get("choice") or [content]
                    other = max(
                        allowed,
                        key=lambda c: abs(allowed.index(c) - allowed.index(content)) if content in allowed else 0,
                    )
                    top = [{"token": content, "logprob": -0.2877}, {"token": other, "logprob": -1.3863}]
                    choice["logprobs"] = {"content": [{"token": content, "top_logprobs": top}]}
                body = json.dumps({"choices": [choice]}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the judge gave up on this request (its deadline)
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def listener() -> Iterator[tuple[int, list[str]]]:
    """A TCP server on the host's loopback that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, address = server.accept()
                accepted.append(str(address))
                connection.close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@contextlib.contextmanager
def loopback_http(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 answering with ``handler``, on a thread; its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
