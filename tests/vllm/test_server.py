"""GRPO, probe and evaluation against a real vLLM server process on 127.0.0.1 (``grpoflow vllm-serve``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from flows.pipeline import pipeline
from tasks.tracking import RUN_ID_TAG, client_for

REPO = Path(__file__).resolve().parents[2]


def _server_config(make_vllm_config: Any, output_dir: Path, url: str, **overrides: Any) -> Any:
    return make_vllm_config(
        output_dir,
        **{
            "grpo.generation.vllm_mode": "server",
            "grpo.generation.vllm_server_base_url": url,
            "grpo.generation.vllm_server_timeout_s": 60,
            **overrides,
        },
    )


def test_tiny_pipeline_against_a_real_server(vllm_server: Any, tmp_path: Path, make_vllm_config: Any) -> None:
    vllm_server.ensure_up()
    steering = {"grpo.eval_steps": 1, "grpo.eval_prompts": 8, "grpo.select": "best"}  # hold-out through the server
    config = _server_config(make_vllm_config, tmp_path / "outputs", vllm_server.url, **steering)
    summary = pipeline(config, "vllm-server")
    assert summary["promotion"]["version"] == "1"
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = 'vllm-server'")
    grpo = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo").data
    assert grpo.tags["generation_backend"] == "vllm-server" and grpo.tags["generation"].startswith(
        "vllm-server: 2 batches"
    )
    assert grpo.metrics["sampling/sampling_logp_difference/mean"] < 1e-4
    assert "eval_holdout_pass_at_1" in grpo.metrics and summary["grpo"]["selected"]["select"] == "best"
    # Every result names its engine: the evaluation, its stage run, the registered version.
    assert summary["evaluation"]["engine"] == "vllm-server"
    evaluate = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "evaluate").data
    assert evaluate.params["generation_engine"] == "vllm-server"
    version = client.get_model_version(config.tracking.registered_model_name, "1")
    assert version.tags["evaluation_engine"] == "vllm-server"
    # grpoflow vllm-serve said where its log is while it started, and "up" only once it answered.
    said = vllm_server.log.read_text()
    assert "its log:" in said and said.index("its log:") < said.index("vLLM server up on")


def test_a_stopped_server_is_one_clear_error_before_anything_runs(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [
        str(Path(sys.executable).parent / "grpoflow"),
        "run",
        str(REPO / "configs" / "tiny.yaml"),
        "--set",
        f"output_dir={tmp_path / 'outputs'}",
        "--set",
        "grpo.generation.vllm_mode=server",
        "--set",
        f"grpo.generation.vllm_server_base_url={url}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 4
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "fix the"))]
    assert len(errors) == 2 and f"vLLM server {url} is not answering" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "outputs" / "mlflow.db").exists()  # nothing started


class StopServerAfterCheckpoint(TrainerCallback):
    def __init__(self, server: Any, step: int) -> None:
        self.server, self.step = server, step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.server.stop()


def test_a_server_that_dies_mid_run_fails_grpo_naming_it_and_resume_continues(
    vllm_server: Any, tmp_path: Path, make_vllm_config: Any, vllm_model_dir: Path
) -> None:
    from tasks.grpo import run_grpo
    from tasks.layout import CHECKPOINTS
    from tasks.models import VllmServerUnavailable
    from tasks.training import resumable_checkpoint
    from tasks.validate import run_validate

    vllm_server.ensure_up()
    config = _server_config(
        make_vllm_config, tmp_path / "outputs", vllm_server.url, **{"grpo.max_steps": 4, "grpo.checkpoint_steps": 2}
    )
    split = run_validate(config, tmp_path / "split")
    stage = tmp_path / "grpo"
    with pytest.raises(VllmServerUnavailable, match=f"vLLM server {vllm_server.url} is not answering"):
        run_grpo(config, split.train_path, vllm_model_dir, None, stage, [StopServerAfterCheckpoint(vllm_server, 2)])
    assert resumable_checkpoint(stage / CHECKPOINTS).name == "checkpoint-2"
    vllm_server.start()
    result = run_grpo(config, split.train_path, vllm_model_dir, None, stage)
    assert result.steps == 4 and result.generated_by.startswith("vllm-server: 2 batches")  # steps 3 and 4 only
    assert (stage / "adapter" / "adapter_model.safetensors").is_file()


def test_probe_and_evaluation_sample_through_the_server(
    vllm_server: Any, tmp_path: Path, make_vllm_config: Any, vllm_model_dir: Path, lora_adapter_h32: Path
) -> None:
    from tasks.inputs import render_prompt
    from tasks.models import ServerSampler, policy_sampler

    vllm_server.ensure_up()
    config = _server_config(make_vllm_config, tmp_path / "outputs", vllm_server.url)
    sampler = policy_sampler(config, vllm_model_dir, lora_adapter_h32, 64)
    assert isinstance(sampler, ServerSampler)
    plain = make_vllm_config(tmp_path / "outputs", **{"grpo.generation.backend": "transformers"})
    reference = policy_sampler(plain, vllm_model_dir, lora_adapter_h32, 64)
    prompts = [render_prompt(sampler.tokenizer, f"What is {i} + {i}?", None) for i in range(12)]
    ours = sampler.sample(prompts, greedy=True, max_new_tokens=12)
    theirs = reference.sample(prompts, greedy=True, max_new_tokens=12)
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(prompts) >= 0.75
    seen: list[tuple[int, int]] = []
    sampled = sampler.sample(prompts, n=16, max_new_tokens=12, progress=lambda done, of: seen.append((done, of)))
    assert [len(group) for group in sampled] == [16] * len(prompts)
    # Concurrent requests of 4 prompts × 16 samples: the bar moves as each returns.
    assert sorted(seen) == [(4, 12), (8, 12), (12, 12)]


def test_evaluation_through_the_server_is_cached_when_it_serves_our_model(
    vllm_server: Any, tmp_path: Path, make_vllm_config: Any, vllm_model_dir: Path, lora_adapter_h32: Path
) -> None:
    from tasks.evaluate import ModelSpec
    from tasks.evaluation.cache import sample_for_evaluation
    from tasks.inputs import render_prompt
    from tasks.models import GenerationStats, policy_sampler

    vllm_server.ensure_up()
    config = _server_config(
        make_vllm_config, tmp_path / "outputs", vllm_server.url, **{"evaluation.cache": True, "seed": 7919}
    )
    sampler = policy_sampler(config, vllm_model_dir, lora_adapter_h32, 64)
    served, _ = sampler.cache_identity(vllm_model_dir)
    assert served is not None and Path(served["root"]) == vllm_model_dir and served["version"].startswith("0.31")
    elsewhere, reason = sampler.cache_identity(tmp_path)
    assert elsewhere is None and f"not {tmp_path}" in reason
    spec = ModelSpec("sft", vllm_model_dir, lora_adapter_h32)
    prompts = [render_prompt(sampler.tokenizer, f"What is {i} * 3?", None) for i in range(6)]
    first = sample_for_evaluation(config, spec, sampler, prompts, GenerationStats(), None)
    again = sample_for_evaluation(config, spec, sampler, prompts, GenerationStats(), None)
    assert again == first  # the server samples afresh each time: equal only because the second came from the cache
    fresh = sampler.sample(prompts, n=config.evaluation.n_samples, max_new_tokens=config.evaluation.max_new_tokens)
    assert fresh != first[1]  # ... as a third draw, not cached, shows


def test_the_server_refuses_a_client_without_its_key(vllm_server: Any) -> None:
    from tasks.models import VllmServerAuthError, VllmServerClient

    vllm_server.ensure_up()
    with pytest.raises(VllmServerAuthError, match="refused the API key grpoflow sent"):
        VllmServerClient(vllm_server.url, api_key="not-the-key").check()
    VllmServerClient(vllm_server.url).check()  # the key from VLLM_API_KEY
    # grpoflow's own server says its log-prob mode (a model name of its own), as TRL's correction needs to know
    assert VllmServerClient(vllm_server.url).logprobs_mode() == "processed_logprobs"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap gives the client a folder the server cannot see")
def test_preflight_fails_clearly_when_the_server_cannot_read_the_handover_folder(
    vllm_server: Any, tmp_path: Path
) -> None:
    """A trainer on "another machine" (a private /tmp the server does not see) and a folder the server does."""
    from tasks.models import VllmServerClient

    vllm_server.ensure_up()
    VllmServerClient(vllm_server.url).check_reads(tmp_path / "handover")  # same host: it reads it
    script = (
        "from pathlib import Path\nfrom tasks.models import VllmServerClient\n"
        f"VllmServerClient({vllm_server.url!r}).check_reads(Path('/tmp/handover'))\n"
    )
    from tasks.training.nodes.launchers import kept_paths

    private = ["bwrap", "--bind", "/", "/", "--dev-bind", "/dev", "/dev", "--tmpfs", "/tmp"]
    private += [arg for path in kept_paths() for arg in ("--ro-bind", path, path)]  # a clone under /tmp stays seen
    done = subprocess.run([*private, sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot read /tmp/handover, where GRPO hands it each step's adapter" in done.stderr, done.stderr[-2000:]
