"""The vLLM server's API key, without vLLM: a real HTTP server that guards its ``/v1`` routes as vLLM's
``--api-key`` does (``/health`` open), the client sending the key from the environment or a file, and
``grpoflow vllm-serve`` refusing an address other hosts reach without one."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks.models.vllm_server import VllmServerAuthError, VllmServerClient, api_key_from_environment


class GuardedHandler(http.server.BaseHTTPRequestHandler):
    key = "right-key"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": "Unauthorized"}')
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def guarded_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), GuardedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_missing_or_wrong_key_is_one_clear_error_and_the_right_one_passes(
    guarded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY_FILE", raising=False)
    with pytest.raises(VllmServerAuthError, match=r"wants an API key \(HTTP 401 on /v1/models\): set VLLM_API_KEY"):
        VllmServerClient(guarded_server).check()
    with pytest.raises(VllmServerAuthError, match="refused the API key grpoflow sent"):
        VllmServerClient(guarded_server, api_key="wrong").check()
    monkeypatch.setenv("VLLM_API_KEY", "right-key")
    VllmServerClient(guarded_server).check()
    secret = tmp_path / "key"
    secret.write_text("right-key\n")
    assert api_key_from_environment({"VLLM_API_KEY_FILE": str(secret), "VLLM_API_KEY": "other"}) == "right-key"
    with pytest.raises(VllmServerAuthError, match="VLLM_API_KEY_FILE .*missing"):
        api_key_from_environment({"VLLM_API_KEY_FILE": str(tmp_path / "missing")})


def test_vllm_serve_on_an_open_address_needs_a_key(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "vllm-serve", "configs/tiny.yaml", "--host", "0.0.0.0", "--print"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "give it an API key with VLLM_API_KEY" in said.replace("\n", " ") and len(said.strip().splitlines()) <= 3
    (tmp_path / "key").write_text("k")
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "vllm-serve", "configs/tiny.yaml", "--host", "0.0.0.0", "--print"]
        + ["--api-key-file", str(tmp_path / "key")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--api-key " not in done.stdout and "VLLM_API_KEY" not in done.stdout  # never on a command line


def test_vllm_serve_judge_prints_the_key_the_way_it_got_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A key from a file: the judge's args name that file (it read only the variable before, so every verdict was a
    401); a key from the variable: the variable. Either way the printed args load as a judge's settings."""
    from reward_fns.judges import check_judge_args

    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    (tmp_path / "key").write_text("file-key\n")
    ways = {"file": ["--api-key-file", str(tmp_path / "key")], "variable": []}
    for way, extra in ways.items():
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", "vllm-serve", "configs/tiny.yaml", "--judge", str(tiny_model_dir)]
            + ["--host", "0.0.0.0", "--print", *extra],
            capture_output=True,
            text=True,
            env=env if way == "file" else {**env, "VLLM_API_KEY": "variable-key"},
            cwd=Path(__file__).resolve().parents[3],
        )
        assert done.returncode == 0, done.stdout + done.stderr
        args = json.loads(done.stdout.split("llm_judge args: ", 1)[1].splitlines()[0])
        expected = {"api_key_file": str(tmp_path / "key")} if way == "file" else {"api_key_env": "VLLM_API_KEY"}
        assert expected.items() <= args.items(), args
        assert "file-key" not in done.stdout and "variable-key" not in done.stdout
        os.environ["VLLM_API_KEY"] = "variable-key"  # the judge reads the variable where the printed args say so
        try:
            settings = check_judge_args("llm_judge", args)
            assert settings.api_key() == ("file-key" if way == "file" else "variable-key")
        finally:
            del os.environ["VLLM_API_KEY"]
