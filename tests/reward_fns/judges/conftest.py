"""An OpenAI-compatible endpoint on loopback whose behaviour a test sets: a judge that answers by a rule, is down,
slow, flaky or answers garbage. It stands in for a remote judge's failure modes (a real vLLM server judges in
``tests/vllm``); every request is counted and kept."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


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
                body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
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
