"""Same config, seed and thread count → the same adapter: the tiny pipeline twice, the second time with processes
burning every core beside it, gives SFT and GRPO adapters with the same bytes and the same evaluation table."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flows.pipeline import pipeline
from tasks.config import PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def _adapter_hashes(run_dir: Path) -> dict[str, str]:
    return {
        stage: hashlib.sha256((run_dir / stage / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()
        for stage in ("sft", "grpo")
    }


def _table(summary: dict[str, Any]) -> dict[str, Any]:
    """The evaluation as promotion reads it, without the one field that measures time (tokens per second)."""
    models = summary["evaluation"]["models"]
    return {name: {k: v for k, v in scores.items() if k != "tokens_per_second"} for name, scores in models.items()}


def _run(output: Path, run_id: str) -> tuple[PipelineConfig, dict[str, Any]]:
    # Its own store (no champion); no evaluation cache, so the second run samples its evaluation again.
    config = load_config(REPO / "configs" / "tiny.yaml", {"output_dir": str(output), "evaluation": {"cache": False}})
    return config, pipeline(config, run_id)


@pytest.mark.alone  # the load beside it is the burners, nothing else
def test_the_same_seed_gives_the_same_adapter_beside_a_cpu_burner(tmp_path: Path) -> None:
    config, first = _run(tmp_path / "idle", "repro")
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        _, second = _run(tmp_path / "loaded", "repro")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert _adapter_hashes(tmp_path / "idle" / "repro") == _adapter_hashes(tmp_path / "loaded" / "repro")
    assert _table(first) == _table(second)
    assert first["evaluation"]["models"]["grpo"]["n_samples"] == config.evaluation.n_samples
    # What a rerun needs is on the parent run: seed, thread count, library versions.
    import torch
    from mlflow import MlflowClient

    tags = MlflowClient(config.resolved_tracking_uri()).get_run(first["mlflow"]["parent_run_id"]).data.tags
    assert tags["grpoflow.seed"] == str(config.seed)
    assert tags["grpoflow.torch_threads"] == str(torch.get_num_threads())
    assert tags["grpoflow.version.torch"] == torch.__version__ and "grpoflow.version.trl" in tags
