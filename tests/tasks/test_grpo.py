from __future__ import annotations

import pytest
from trl import GRPOConfig

from tasks.config import ConfigError, GenerationSettings, load_config
from tasks.grpo import generation_args, resolve_backend


def test_auto_backend_picks_vllm_only_with_cuda_and_vllm() -> None:
    assert resolve_backend("auto", cuda=True, vllm_installed=True) == "vllm"
    assert resolve_backend("auto", cuda=True, vllm_installed=False) == "transformers"
    assert resolve_backend("auto", cuda=False, vllm_installed=True) == "transformers"
    assert resolve_backend("auto") == "transformers"  # this machine: no CUDA, no vllm


def test_asking_for_vllm_without_it_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no CUDA"):
        resolve_backend("vllm", cuda=False, vllm_installed=True)
    with pytest.raises(RuntimeError, match="grpoflow\\[gpu\\]"):
        resolve_backend("vllm", cuda=True, vllm_installed=False)


def test_vllm_arguments_are_accepted_by_trl(tmp_path) -> None:
    server = GenerationSettings(vllm_mode="server", vllm_server_base_url="http://vllm:8000")
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        **generation_args(server, "vllm"),
    )
    assert args.use_vllm and args.vllm_mode == "server" and args.vllm_server_base_url == "http://vllm:8000"
    colocate = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", **generation_args(GenerationSettings(), "vllm")
    )
    assert colocate.vllm_mode == "colocate" and colocate.vllm_gpu_memory_utilization == 0.3


def test_server_mode_without_url_fails_at_config_load() -> None:
    with pytest.raises(ConfigError, match="vllm_server_base_url"):
        load_config(overrides={"grpo.generation.vllm_mode": "server"})
