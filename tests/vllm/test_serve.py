"""``grpoflow serve`` on vLLM's CPU build: the adapters loaded at run time into two LoRA slots, four clients through
a promotion and a rollback with no failed request, and the versions that fail their checks never served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from flows.services import free_port, stop_group
from tasks.registry import client_for, move_champion
from tasks.serving import REFUSED_TAG

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8


def test_serve_on_vllm_follows_the_alias_without_a_failed_request(
    tmp_path: Path, make_vllm_config, register_version, serve_harness
) -> None:
    overrides = {"tracking.registered_model_name": "served-h32", "serving.poll_interval_s": 0.2}
    config = make_vllm_config(tmp_path / "outputs", **overrides)
    client = client_for(config.resolved_tracking_uri())
    name = config.tracking.registered_model_name
    first, second = register_version(config, 1), register_version(config, 2)
    corrupted = register_version(config, 3, corrupt=True)
    wrong_smoke = register_version(config, 4, smoke_answers=["not what it says"] * 3)
    move_champion(client, name, first, "the first champion")

    port, harness = free_port(), serve_harness
    url = f"http://127.0.0.1:{port}"
    sets = [f"--set={k}={v}" for k, v in {"output_dir": config.output_dir, **overrides}.items()]
    sets += [f"--set={k}={v}" for k, v in (("model.source", "tiny-random-h32"), ("model.precision", "fp32"))]
    sets += ["--set=grpo.generation.vllm_max_model_len=512"]
    config_args = ["--config", str(REPO / "configs" / "tiny.yaml"), *sets]
    log = tmp_path / "serve.log"
    server = harness.start([*config_args, "--engine", "vllm"], log, port, timeout=600)
    try:
        with harness.clients(url, 4, MAX_TOKENS) as clients:
            harness.wait_for(lambda: clients.seen(first), 120, "answers from v1")
            move_champion(client, name, second, "promoted by the test")
            promoted_in = harness.wait_for(lambda: clients.seen(second), 120, "answers from the promoted v2")
            rollback = [sys.executable, "-m", "flows.cli", "rollback", name, *config_args]
            subprocess.run(rollback, cwd=REPO, check=True, capture_output=True, timeout=120)
            rolled_back_in = harness.wait_for(lambda: clients.seen(first), 120, "answers from v1 after the rollback")
            for refused in (corrupted, wrong_smoke):
                move_champion(client, name, refused, "a version that fails its checks")
                tagged = lambda v=refused: REFUSED_TAG in client.get_model_version(name, v).tags  # noqa: E731
                harness.wait_for(tagged, 120, "the refusal")
            time.sleep(0.5)
        models = json.loads(harness.get(f"{url}/v1/models")[1])["data"][0]["grpoflow"]
    finally:
        stop_group(server, timeout=60)
    assert server.returncode == 0, log.read_text()[-3000:]

    results = clients.results
    failed = [r for r in results if r[1] != 200]
    assert len(results) >= 20 and not failed, failed[:3]
    assert {r[2]["grpoflow"]["version"] for r in results} == {first, second}
    assert all(r[3].get("x-grpoflow-version") == r[2]["grpoflow"]["version"] for r in results)
    # Greedy on one engine: a version answers a prompt the same way every time, across both switches.
    answers = defaultdict(set)
    for prompt, _, payload, _ in results:
        answers[(payload["grpoflow"]["version"], prompt)].add(payload["choices"][0]["message"]["content"])
    assert all(len(texts) == 1 for texts in answers.values()), answers
    assert any(answers[(first, p)] != answers[(second, p)] for p in harness.prompts if (second, p) in answers)
    assert models["engine"] == "vllm" and models["version"] == first
    assert "digest mismatch" in models["refused"][corrupted]
    assert "agree" in models["refused"][wrong_smoke]  # recorded on transformers: the stated share applies
    assert promoted_in < 60 and rolled_back_in < 60
    print(f"vLLM switch: promoted answered in {promoted_in:.2f} s, rolled back in {rolled_back_in:.2f} s")
