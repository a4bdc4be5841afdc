"""What TRL asks a vLLM server before its importance-sampling correction (its log-prob mode), without vLLM: a real
HTTP server that answers as grpoflow's own server, a dev-mode server, and a stock one that does not say."""

from __future__ import annotations

import http.server
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.models.vllm_server import PROCESSED_LOGPROBS_MARK, SERVED_BASE_NAME, VllmServerClient, server_command
from tests.conftest import loopback_http


class Answers:
    """What the fake server says: its model names and, in dev mode, its config."""

    names: list[str] = [SERVED_BASE_NAME]
    server_info: dict | None = None


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/v1/models"):
            body = {"data": [{"id": name, "root": "/m"} for name in Answers.names]}
        elif self.path.startswith("/server_info") and Answers.server_info is not None:
            body = Answers.server_info
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    with loopback_http(Handler) as url:
        yield url


def test_the_log_prob_mode_is_asked_where_the_server_says_it_and_unknown_is_one_warning(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    command = server_command(Path("/m"), python="python")
    assert command[command.index("--served-model-name") + 2] == PROCESSED_LOGPROBS_MARK  # grpoflow's server says it
    Answers.names, Answers.server_info = [SERVED_BASE_NAME, PROCESSED_LOGPROBS_MARK], None
    assert VllmServerClient(server).get_server_info()["model_config"]["logprobs_mode"] == "processed_logprobs"
    Answers.names = [SERVED_BASE_NAME]
    Answers.server_info = {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}  # dev mode
    assert VllmServerClient(server).logprobs_mode() == "raw_logprobs"  # TRL warns about this one itself
    Answers.server_info = None  # a stock server: nothing says
    with caplog.at_level(logging.WARNING):
        info = VllmServerClient(server).get_server_info()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "does not say its log-prob mode" in warned[0]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"  # TRL's own warning left quiet
