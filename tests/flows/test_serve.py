"""``grpoflow serve`` end to end on the transformers engine: the real command over a real registry, four clients
answering through a promotion and a ``grpoflow rollback``, and two versions that fail their checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flows.services import free_port, stop_group
from tasks.config import load_config
from tasks.registry import alias_version, client_for, move_champion
from tasks.serving import REFUSED_TAG

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
SERVE_PROMPTS = ("What is 2+3?", "What is 7*6?", "Name a prime number.")  # the clients' (tests/conftest.py)


def offline_answers(config: Any, version: str) -> dict[str, str]:
    """What ``grpoflow generate`` answers each prompt with this version (greedy, the config's precision)."""
    import tempfile

    from tasks.inputs import render_prompt
    from tasks.models import generate_completions, load_policy, load_tokenizer, resolve_model_source
    from tasks.registry import fetch_adapter

    name = config.tracking.registered_model_name
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter, _ = fetch_adapter(config.resolved_tracking_uri(), f"models:/{name}/{version}", Path(scratch))
        base_dir = resolve_model_source(base)
        tokenizer, policy = load_tokenizer(base_dir), load_policy(base_dir, adapter, precision=config.model.precision)
        texts = [
            render_prompt(tokenizer, [{"role": "user", "content": p}], config.data.system_prompt) for p in SERVE_PROMPTS
        ]
        answers = generate_completions(
            policy, tokenizer, texts, greedy=True, max_new_tokens=MAX_TOKENS, precision=config.model.precision
        )
    return {prompt: group[0] for prompt, group in zip(SERVE_PROMPTS, answers, strict=True)}


def test_serve_follows_champion_through_promotion_and_rollback_without_a_failed_request(
    tmp_path: Path, register_version, serve_harness
) -> None:
    import torch

    overrides = {
        "output_dir": str(tmp_path / "outputs"),
        "tracking.registered_model_name": "served-tiny",
        "serving.poll_interval_s": 0.2,
        "serving.threads": 1,  # the offline answers below are computed on this test's one thread
    }
    config = load_config(REPO / "configs" / "tiny.yaml", overrides)
    client = client_for(config.resolved_tracking_uri())
    name = config.tracking.registered_model_name
    first, second = register_version(config, 1), register_version(config, 2)
    corrupted = register_version(config, 3, corrupt=True)
    wrong_smoke = register_version(config, 4, smoke_answers=["not what it says"] * 3)
    move_champion(client, name, first, "the first champion")

    port = free_port()
    url, harness = f"http://127.0.0.1:{port}", serve_harness
    sets = [f"--set={key}={value}" for key, value in overrides.items()]
    config_args = ["--config", str(REPO / "configs" / "tiny.yaml"), *sets]
    log = tmp_path / "serve.log"
    server = harness.start([*config_args, "--engine", "transformers"], log, port)
    try:
        assert json.loads(harness.get(f"{url}/health")[1])["serving"] == f"{name}@champion:v{first}"
        with harness.clients(url, 4, MAX_TOKENS) as clients:
            harness.wait_for(lambda: clients.seen(first), 60, "answers from v1")
            move_champion(client, name, second, "promoted by the test")
            promoted_in = harness.wait_for(lambda: clients.seen(second), 60, "answers from the promoted v2")
            rollback = [sys.executable, "-m", "flows.cli", "rollback", name, *config_args]
            subprocess.run(rollback, cwd=REPO, check=True, capture_output=True, timeout=120)
            assert str(alias_version(client, name, "champion").version) == first
            rolled_back_in = harness.wait_for(lambda: clients.seen(first), 60, "answers from v1 after the rollback")
            for refused in (corrupted, wrong_smoke):  # neither ever answers; v1 keeps answering
                move_champion(client, name, refused, "a version that fails its checks")
                tagged = lambda v=refused: REFUSED_TAG in client.get_model_version(name, v).tags  # noqa: E731
                harness.wait_for(tagged, 60, "the refusal")
            time.sleep(0.5)  # requests keep coming after the refusals
        models = json.loads(harness.get(f"{url}/v1/models")[1])["data"][0]["grpoflow"]
        metrics = harness.get(f"{url}/metrics")[1]
    finally:
        stop_group(server)
    assert server.returncode == 0, log.read_text()[-3000:]  # a stopped server is a clean exit

    results = clients.results
    assert len(results) >= 20
    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:3]
    versions = {r[2]["grpoflow"]["version"] for r in results}
    assert versions == {first, second}  # the refused versions never answered
    assert all(r[3].get("x-grpoflow-version") == r[2]["grpoflow"]["version"] for r in results)
    assert all(r[2]["model"] == f"{name}@champion:v{r[2]['grpoflow']['version']}" for r in results)
    assert all(r[2]["choices"][0]["finish_reason"] in ("stop", "length") for r in results)
    # Each answer is the one its version gives offline (grpoflow generate's path, the same precision and thread).
    torch.set_num_threads(1)
    offline = {version: offline_answers(config, version) for version in (first, second)}
    assert offline[first] != offline[second]
    for prompt, _, payload, _ in results:
        assert payload["choices"][0]["message"]["content"] == offline[payload["grpoflow"]["version"]][prompt]

    assert set(models["refused"]) == {corrupted, wrong_smoke}
    assert "digest mismatch" in models["refused"][corrupted]
    assert "answered differently" in models["refused"][wrong_smoke]
    assert models["version"] == first and models["last_switch"]["from"] == second
    assert "grpoflow_serve_failed_checks_total 2" in metrics and "grpoflow_serve_switches_total 2" in metrics
    assert promoted_in < 30 and rolled_back_in < 30
    runs = client.search_runs(
        [client.get_experiment_by_name(config.tracking.experiment_name).experiment_id],
        "tags.`grpoflow.stage` = 'serve'",
    )
    assert runs and runs[0].data.metrics["switches"] == 2 and runs[0].info.status == "FINISHED"
    print(f"switch: promoted answered in {promoted_in:.2f} s, rolled back in {rolled_back_in:.2f} s")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--host", "0.0.0.0"], "give it an API key"),
        (["no-such-model@champion"], "no registered model 'no-such-model'"),
    ],
)
def test_serve_refuses_what_it_cannot_serve_in_a_few_lines(tmp_path: Path, args: list[str], said: str) -> None:
    from tasks.registry import client_for as store

    output = tmp_path / "outputs"
    store(load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(output)}).resolved_tracking_uri())
    command = [sys.executable, "-m", "flows.cli", "serve", "--config", str(REPO / "configs" / "tiny.yaml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPOFLOW_SERVE_API_KEY")}
    done = subprocess.run(
        [*command, f"--set=output_dir={output}", *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and len(done.stderr.strip().splitlines()) <= 3 + done.stderr.count("config:")
