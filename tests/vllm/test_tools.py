"""Tool use on vLLM colocate: TRL's tool loop samples every round through the engine in the training process, and
the probes and evaluation run grpoflow's tool loop over the same engine; the ledger's token counts show the loss
read no tool answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flows.pipeline import pipeline
from tasks.config import load_config
from tasks.training import read_ledger

REPO = Path(__file__).resolve().parents[2]


def test_the_tool_pipeline_on_vllm_colocate_calls_the_tool_and_trains_on_the_models_tokens_only(
    tmp_path: Path,
) -> None:
    from tasks.environments import prepare_tokenizer, tool_suffix_ids
    from tasks.models import TINY_RANDOM_VLLM_TOOLS, load_tokenizer, resolve_model_source

    overrides: dict[str, Any] = {
        "output_dir": str(tmp_path / "outputs"),
        "model.source": TINY_RANDOM_VLLM_TOOLS,
        "model.precision": "fp32",
        "grpo.generation.backend": "vllm",
        "grpo.generation.vllm_max_model_len": 1024,
        "probe.num_prompts": 2,
        "evaluation.num_prompts": 2,
    }
    config = load_config(REPO / "configs" / "tiny-tools.yaml", overrides)
    summary = pipeline(config, "vllm-tools")
    assert summary["promotion"]["version"] == "1"
    assert summary["evaluation"]["engine"] == "vllm-colocate"
    assert all("without_tools" in score for score in summary["evaluation"]["models"].values())

    rows = [r for r in read_ledger(config.output_dir / "vllm-tools" / "grpo" / "rollouts") if r["role"] == "grpo"]
    assert {row["backend"] for row in rows} == {"vllm-colocate"}
    tokenizer = load_tokenizer(resolve_model_source(TINY_RANDOM_VLLM_TOOLS))
    prepare_tokenizer(tokenizer, config.tools.chat_template, config.model.source)
    answered = 0
    for row in rows:
        turns = json.loads(row["turns"])
        rounds: list[list[dict]] = []  # the tool answers after each call, a list per round
        for before, turn in zip([None, *turns], turns, strict=False):
            if turn["role"] == "tool":
                if before is None or before["role"] != "tool":
                    rounds.append([])
                rounds[-1].append({"role": "tool", "name": turn["name"], "content": turn["content"]})
        assert row["trained_tokens"] + row["tool_tokens"] == row["completion_tokens"]
        assert row["tool_tokens"] == sum(len(tool_suffix_ids(tokenizer, answers)) for answers in rounds)
        answered += bool(rounds)
    assert answered, "no rollout called the tool through vLLM"
