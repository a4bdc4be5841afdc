"""An LLM judge served by a real vLLM server process (``grpoflow vllm-serve --judge``): its answers fixed to the
allowed scores by ``structured_outputs``, reproducible per item though it samples, and the tiny pipeline trained on
its verdicts twice with the same seed — the same adapter bytes through the verdict cache (a CPU server takes no
per-request seed), the second run and ``rescore`` asking it nothing (the server's own request counter)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner

from flows.cli import main
from flows.pipeline import pipeline
from reward_fns.judges import LLMJudge, LLMJudgeSettings
from tasks.config import load_config

REPO = Path(__file__).resolve().parents[2]


class JudgeServer:
    def __init__(self, log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = log
        grpoflow = str(Path(os.sys.executable).parent / "grpoflow")
        command = [grpoflow, "vllm-serve", str(REPO / "configs" / "tiny.yaml"), "--port", str(self.port)]
        command += ["--judge", "tiny-random-h32", "--set", "model.precision=fp32"]
        command += ["--set", "grpo.generation.vllm_max_model_len=1024"]  # a character a token: room for the rubric
        # The judge's key from a file, and no key variable anywhere: the printed args must name the file, and every
        # verdict below (the pipeline's included) is asked with the key read from it.
        key_file = log.with_name("judge-api-key")
        key_file.write_text("judge-file-key-5e1d\n")
        command += ["--api-key-file", str(key_file)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_API_KEY")}
        with log.open("ab") as handle:
            self.process = subprocess.Popen(
                command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        from tasks.models import VllmServerClient

        client = VllmServerClient(f"http://127.0.0.1:{self.port}", api_key="judge-file-key-5e1d")
        client.wait_until_up(240, alive=lambda: self.process.poll() is None)
        printed = re.search(r"llm_judge args: (\{.*?\})", " ".join(log.read_text().split()))
        self.args = json.loads(printed[1])
        assert self.args["api_key_file"] == str(key_file.resolve()) and "api_key_env" not in self.args
        unkeyed = httpx.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", json={}, timeout=30)
        assert unkeyed.status_code == 401  # the server wants the key the judge reads from the file

    def requests(self) -> float:
        """Requests the server finished, from its own Prometheus counter."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JudgeServer]:
    server = JudgeServer(tmp_path_factory.mktemp("judge") / "server.log")
    yield server
    server.stop()


def test_vllm_serve_judge_prints_the_reward_args_and_fixes_the_answer_form(judge_server: JudgeServer) -> None:
    args = judge_server.args
    assert args["url"] == f"http://127.0.0.1:{judge_server.port}/v1" and args["model"] == "judge"
    assert re.fullmatch(r"[0-9a-f]{20}", args["model_digest"])
    settings = LLMJudgeSettings(**args, temperature=1.0)  # it samples: a random model, unconstrained, says anything
    items = {"completions": [f"It is {n}." for n in range(12)], "prompts": ["What is 6*7?"] * 12}
    verdicts = asyncio.run(LLMJudge(settings)(**items, ground_truth=["42"] * 12))
    assert None not in verdicts and all(round(v * 10) == v * 10 for v in verdicts)  # only 0..10: structured_outputs
    assert args["seed_requests"] is False  # a CPU server: vLLM's CPU engine dies on a per-request seed
    assert judge_server.process.poll() is None


def _judged(tmp_path: Path, args: dict, name: str):
    judge = {"name": "llm_judge", "args": {**args, "temperature": 1.0}, "weight": 0.5}
    config = load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(tmp_path / name)})
    raw = config.model_dump(mode="json")
    raw["rewards"] = [*raw["rewards"], judge]
    raw["evaluation"]["forgetting"] = False
    raw["canaries"]["judge_min_ordered"] = 0.0  # a random judge orders nothing; its canaries still run (cached)
    return type(config).model_validate(raw)


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def _adapter(config, run: str) -> str:
    return hashlib.sha256(
        (config.output_dir / run / "grpo" / "adapter" / "adapter_model.safetensors").read_bytes()
    ).hexdigest()


def test_the_same_seed_with_a_sampling_judge_gives_the_same_adapter_through_the_cache(
    judge_server: JudgeServer, tmp_path: Path
) -> None:
    first = _judged(tmp_path, judge_server.args, "first")
    assert pipeline(first, "judged")["promotion"]["version"] == "1"
    asked = judge_server.requests()
    second = _judged(tmp_path, judge_server.args, "second")
    pipeline(second, "judged")
    assert judge_server.requests() == asked  # every verdict of the rerun came from the cache
    assert _adapter(first, "judged") == _adapter(second, "judged")
    config_file = tmp_path / "judged.yaml"
    config_file.write_text(yaml.safe_dump(first.model_dump(mode="json")))
    result = CliRunner().invoke(_Command(), ["rescore", "judged", "--reward", "llm_judge", "-c", str(config_file)])  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["judge"]["requests"] == 0 and report["judge"]["asked"] == 0, report
    assert report["agreement"] == 1.0, report
    assert judge_server.requests() == asked
