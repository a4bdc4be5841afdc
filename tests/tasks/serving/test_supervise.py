"""The supervisor keeps a real server process up: restarted when it exits, when it stops answering its health
checks, and given up on past the hourly limit."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from flows.services import free_port
from tasks.serving.supervise import RestartLimit, Supervision, supervise

# A health endpoint that answers for ``seconds`` then exits (code 3), or stops answering while it keeps running.
SERVER = """
import http.server, sys, threading, time
mode, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
started = time.monotonic()
class Health(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        if mode == "hang" and time.monotonic() - started > seconds:
            time.sleep(30)
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(seconds if mode == "exit" else 3600)
sys.exit(3)
"""


@pytest.mark.parametrize(("mode", "why"), [("exit", "exited with code 3"), ("hang", "health checks in a row failed")])
def test_a_server_that_exits_or_stops_answering_is_restarted(tmp_path: Path, mode: str, why: str) -> None:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    url = f"http://127.0.0.1:{port}/health"
    watch = Supervision(url, check_every_s=0.2, unhealthy_after=2, start_grace_s=10, health_timeout_s=0.3)
    stop, restarts = threading.Event(), []

    def restarted(count: int, said: str) -> None:
        restarts.append(said)
        if count == 2:
            stop.set()

    command = [sys.executable, str(script), mode, str(port), "1.0"]
    assert supervise(command, watch, tmp_path / "serve.log", stop, restarted) == 2
    assert len(restarts) == 2 and all(why in said for said in restarts)


def test_past_the_hourly_limit_the_supervisor_gives_up(tmp_path: Path) -> None:
    watch = Supervision("http://127.0.0.1:9/health", check_every_s=0.1, max_restarts_per_hour=1)
    with pytest.raises(RestartLimit, match="failed 2 times within an hour"):
        supervise([sys.executable, "-c", "raise SystemExit(1)"], watch, tmp_path / "serve.log", threading.Event())
