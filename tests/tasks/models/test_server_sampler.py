"""The server sampler's adapters, without vLLM: a real HTTP server that answers as vLLM's OpenAI server does and
records what it was asked. An adapter folder anywhere (a stage's hold-out checkpoint, an SFT adapter) reaches the
server as a copy under the hand-over folder the pre-flight checks, and is unloaded and removed after its prompts."""

from __future__ import annotations

import http.server
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.models import load_tokenizer
from tasks.models.vllm_server import ServerSampler, VllmServerClient
from tests.conftest import loopback_http


class Recorder(http.server.BaseHTTPRequestHandler):
    loaded: dict[str, str] = {}  # name -> path, as the server holds them
    seen: list[tuple[str, bool]] = []  # (path loaded, whether it held the adapter's files then)
    models: list[str] = []  # the model each completion request named

    def _answer(self, body: dict) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        names = ["base", *self.loaded]
        self._answer({"data": [{"id": name, "root": "/m"} for name in names]})

    def do_POST(self) -> None:  # noqa: N802
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_lora_adapter":
            path = Path(payload["lora_path"])
            Recorder.seen.append((str(path), (path / "adapter_config.json").is_file()))
            Recorder.loaded[payload["lora_name"]] = str(path)
            return self._answer({})
        if self.path == "/v1/unload_lora_adapter":
            Recorder.loaded.pop(payload["lora_name"], None)
            return self._answer({})
        Recorder.models.append(payload["model"])
        n, prompts = payload["n"], payload["prompt"]
        choices = [{"index": i, "text": "4", "token_ids": [5]} for i in range(n * len(prompts))]
        return self._answer({"choices": choices})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    with loopback_http(Recorder) as url:
        yield url


def test_an_adapter_reaches_the_server_through_the_hand_over_folder_and_leaves_no_trace(
    server: str, tiny_model_dir: Path, tiny_adapter: Path, tmp_path: Path
) -> None:
    handover = tmp_path / "handover"
    sampler = ServerSampler(VllmServerClient(server), load_tokenizer(tiny_model_dir), tiny_adapter, handover)
    for _ in range(2):  # e.g. two in-training evaluations
        assert sampler.sample(["What is 2+2?", "What is 3+3?"], n=2, temperature=1.0, max_new_tokens=4) == [
            ["4", "4"],
            ["4", "4"],
        ]
    assert len(Recorder.seen) == 2 and all(held for _, held in Recorder.seen)  # the files were there when loaded
    assert all(Path(path).parent == handover for path, _ in Recorder.seen)  # never the stage's own folder
    assert set(Recorder.models) == {Path(path).name for path, _ in Recorder.seen}
    assert Recorder.loaded == {} and list(handover.iterdir()) == []  # unloaded, and the copies removed


def test_greedy_and_sampled_completions_share_one_hand_over(
    server: str, tiny_model_dir: Path, tiny_adapter: Path, tmp_path: Path
) -> None:
    """Evaluation and the hold-out ask for greedy completions, then samples: the adapter is copied and loaded once
    for both, and still unloaded and removed after them, also when a request fails."""
    Recorder.seen.clear()
    Recorder.models.clear()
    handover = tmp_path / "handover"
    sampler = ServerSampler(VllmServerClient(server), load_tokenizer(tiny_model_dir), tiny_adapter, handover)
    greedy, sampled = sampler.sample_with_greedy(["What is 2+2?"], n=3, temperature=1.0, max_new_tokens=4, seed=1)
    assert greedy == [["4"]] and sampled == [["4", "4", "4"]]
    assert len(Recorder.seen) == 1 and len(Recorder.models) == 2 and len(set(Recorder.models)) == 1
    assert Recorder.loaded == {} and list(handover.iterdir()) == []
    with pytest.raises(ZeroDivisionError), sampler._adapter_loaded():
        raise ZeroDivisionError
    assert Recorder.loaded == {} and list(handover.iterdir()) == [] and sampler._loaded is None
