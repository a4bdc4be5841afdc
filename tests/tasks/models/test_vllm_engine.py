"""The vLLM engine's settings and the server client, without vLLM (tests/vllm runs the real engine and server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.models import VllmServerClient, VllmServerUnavailable, engine_spec, pipeline_engine_spec
from tasks.models.sampling import judge_server_command, pipeline_server_command
from tasks.models.vllm_engine import KV_CACHE_CAP_BYTES, kv_bytes_per_token, max_lora_rank


def test_the_kv_cache_on_a_cpu_holds_the_batch_and_a_gpu_leaves_it_to_vllm(tiny_model_dir: Path) -> None:
    common = {
        "precision_dtype": "float32",
        "lora_rank": 2,
        "max_model_len": 256,
        "max_num_seqs": 32,
        "gpu_memory_utilization": 0.3,
        "kv_cache_gib": None,
        "seed": 0,
    }
    cpu = engine_spec(tiny_model_dir, cuda=False, **common)
    per_token = 2 * 2 * 4 * 16 * 4  # 2 layers, K and V, 4 heads of 16, fp32
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 4) == per_token
    assert cpu.kv_cache_bytes == max(64 * 2**20, per_token * 32 * 256)
    assert engine_spec(tiny_model_dir, cuda=True, **common).kv_cache_bytes is None
    explicit = engine_spec(tiny_model_dir, cuda=True, **{**common, "kv_cache_gib": 0.5})
    assert explicit.kv_cache_bytes == 2**29 and explicit.engine_args()["kv_cache_memory_bytes"] == 2**29
    args = cpu.engine_args()
    assert args["enable_lora"] and args["max_lora_rank"] == 8 and args["dtype"] == "float32"
    assert args["logprobs_mode"] == "processed_logprobs" and args["distributed_executor_backend"] == "external_launcher"


def test_lora_ranks_round_up_to_what_vllm_takes() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 16, 64, 65)] == [1, 8, 8, 16, 16, 64, 128]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        max_lora_rank(1024)


def test_a_pipeline_has_one_engine_spec_and_the_server_gets_the_same_settings(tiny_model_dir: Path) -> None:
    config = load_config(overrides={"model.source": "tiny-random", "model.precision": "bf16"})
    base = tiny_model_dir
    spec = pipeline_engine_spec(config, base)
    assert spec == pipeline_engine_spec(config, base)  # probe, GRPO and evaluation share one engine
    assert spec.dtype == "bfloat16" and spec.max_lora_rank == 16 and spec.kv_cache_bytes <= KV_CACHE_CAP_BYTES
    command, env = pipeline_server_command(config, base, "127.0.0.1", 8123)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CONFIGURE_LOGGING"] == "1"  # its output is the server's log (vllm-serve names the file)
    # On a CPU the server's compute threads bind to every core this process may use (vLLM's default keeps one).
    cores = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith(str(cores[0]))
    assert env["VLLM_CPU_OMP_THREADS_BIND"].endswith(str(cores[-1]))
    joined = " ".join(command)
    assert "--enable-lora --max-lora-rank 16" in joined and "--dtype bfloat16" in joined
    assert f"--kv-cache-memory-bytes {spec.kv_cache_bytes}" in joined and "--port 8123" in joined
    judge, judge_env, on_cpu = judge_server_command(config, base, "127.0.0.1", 8124)  # vllm-serve --judge
    assert on_cpu and "--enable-lora" not in judge and "--served-model-name judge" in " ".join(judge)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in judge_env and judge_env["VLLM_CPU_OMP_THREADS_BIND"]


def test_a_server_that_is_not_there_is_one_error_naming_its_url() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = VllmServerClient(f"http://127.0.0.1:{port}/", connect_timeout_s=1)
    with pytest.raises(VllmServerUnavailable, match=f"vLLM server http://127.0.0.1:{port} is not answering") as error:
        client.check()
    assert error.value.exit_code == 4 and "grpoflow vllm-serve" in str(error.value)


def test_preflight_names_the_missing_vllm_and_the_dead_server(tmp_path: Path) -> None:
    from tasks.models import vllm_installed
    from tasks.preflight import generation_problem

    config = load_config(overrides={"grpo.generation.backend": "vllm", "output_dir": str(tmp_path)})
    problem = generation_problem(config)
    assert (problem is None) == vllm_installed()
    if problem:
        assert problem.startswith("grpo.generation.backend: 'vllm' but vLLM is not installed here")
    server = load_config(
        overrides={"grpo.generation.vllm_mode": "server", "grpo.generation.vllm_server_base_url": "http://127.0.0.1:9"}
    )
    with pytest.raises(VllmServerUnavailable, match="http://127.0.0.1:9"):
        generation_problem(server)
