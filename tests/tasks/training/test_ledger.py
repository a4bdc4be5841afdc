"""The rollout ledger on the tiny model: its rows are the samples TRL trained on, a crash after a checkpoint and a
resume give the same rows as an uninterrupted run, and the filter's set-aside samples are flagged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from tasks.config import PipelineConfig
from tasks.evaluation import group_advantages
from tasks.training import LEDGER_DIR, read_ledger

LENGTH_REWARD = (
    "def longer(completions, **kwargs):\n    return [len(c) / 12 for c in completions]\n\n\n"
    "def half(completions, prompts, **kwargs):\n"
    "    return [0.0 if sum(map(ord, p)) % 2 else len(c) / 12 for p, c in zip(prompts, completions)]\n"
)


def _config(tiny_config: PipelineConfig, tmp_path: Path, reward: str = "longer", **grpo: Any) -> PipelineConfig:
    (tmp_path / "ledger_rewards.py").write_text(LENGTH_REWARD)
    return PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "rewards": [
                {"name": f"ledger_rewards:{reward}", "path": str(tmp_path)},
                {"name": "boxed_format", "weight": 0.2},
            ],
            "grpo": {**tiny_config.grpo.model_dump(), **grpo},
        }
    )


class History(TrainerCallback):
    def __init__(self) -> None:
        self.logs: dict[int, dict[str, float]] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        self.logs.setdefault(state.global_step, {}).update(logs or {})


def test_the_ledger_holds_the_samples_trl_trained_on(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    from tasks.grpo import run_grpo

    config = _config(tiny_config, tmp_path, max_steps=3)
    history = History()
    run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "grpo", [history])
    rows = read_ledger(tmp_path / "grpo" / LEDGER_DIR)
    assert [p.name for p in (tmp_path / "grpo" / LEDGER_DIR).iterdir()] == ["grpo-000001-000003.parquet"]
    for step in (1, 2, 3):
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == config.grpo.batch_size and all(r["trained"] for r in mine)
        logged = history.logs[step]
        for name in ("longer", "boxed_format"):
            mean = sum(r[f"reward/{name}"] for r in mine) / len(mine)
            assert mean == pytest.approx(logged[f"rewards/{name}/mean"], abs=1e-6)
        assert sum(r["reward_total"] for r in mine) / len(mine) == pytest.approx(logged["reward"], abs=1e-6)
        for g in {r["group"] for r in mine}:  # each group's advantages are TRL's formula over its totals
            group = [r for r in mine if r["group"] == g]
            expected = group_advantages([r["reward_total"] for r in group])
            assert [r["advantage"] for r in group] == pytest.approx(expected, abs=1e-4)
    row = rows[0]
    assert row["role"] == "grpo" and row["backend"] == "transformers" and row["completion_tokens"] > 0
    assert '"ground_truth"' in row["columns"] and row["prompt_id"]


class CrashAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("killed")


def test_a_crash_after_a_checkpoint_and_resume_give_the_rows_of_an_uninterrupted_run(
    tiny_config, tiny_split, tiny_model_dir, tmp_path
) -> None:
    """With the speed-ups on (their sampling copy is built again on resume; ``speedups: off`` resumed
    sample-identical already)."""
    from tasks.grpo import run_grpo

    config = _config(tiny_config, tmp_path, max_steps=4, checkpoint_steps=2)
    run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "whole")
    with pytest.raises(RuntimeError, match="killed"):
        run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "resumed", [CrashAfter(3)])
    assert (tmp_path / "resumed" / "checkpoints" / "checkpoint-2" / LEDGER_DIR).is_dir()
    run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "resumed")

    def key(row: dict) -> tuple:
        return row["step"], row["prompt_id"], row["completion"], row["reward_total"]

    whole = read_ledger(tmp_path / "whole" / LEDGER_DIR)
    resumed = read_ledger(tmp_path / "resumed" / LEDGER_DIR)
    assert len(whole) == 4 * config.grpo.batch_size
    assert sorted(map(key, resumed)) == sorted(map(key, whole))  # none lost, none twice


def test_the_filters_set_aside_samples_are_flagged(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    from tasks.grpo import run_grpo

    config = _config(
        tiny_config,
        tmp_path,
        reward="half",
        max_steps=2,
        checkpoint_steps=0,
        dynamic_sampling={"enabled": True, "max_oversample": 1.0},
    )
    run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "grpo")
    rows = read_ledger(tmp_path / "grpo" / LEDGER_DIR)
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        assert sum(r["trained"] for r in mine) == config.grpo.batch_size
        set_aside = {(r["generation_batch"], r["group"]) for r in mine if not r["trained"]}
        for batch, group in set_aside:  # what the filter drew and did not train on had no learning signal
            totals = {r["reward_total"] for r in mine if (r["generation_batch"], r["group"]) == (batch, group)}
            assert len(totals) == 1
    assert any(not r["trained"] for r in rows)


def test_parts_carry_the_schema_version_and_a_newer_one_is_refused_by_name(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.errors import UserError
    from tasks.training import LEDGER_SCHEMA_VERSION, write_part

    part = write_part(tmp_path, [{"role": "probe-base", "completion": "x"}], "probe-base")
    assert pq.read_schema(part).metadata[b"grpoflow.ledger_schema"] == str(LEDGER_SCHEMA_VERSION).encode()
    pq.write_table(pa.table({"role": ["eval"], "completion": ["y"]}), tmp_path / "eval-old.parquet")  # before it
    assert [r["completion"] for r in read_ledger(tmp_path)] == ["y", "x"]

    newer = pa.table({"role": ["eval"]}).replace_schema_metadata(
        {b"grpoflow.ledger_schema": str(LEDGER_SCHEMA_VERSION + 1).encode()}
    )
    pq.write_table(newer, tmp_path / "eval-new.parquet")
    with pytest.raises(
        UserError, match=rf"eval-new\.parquet: rollout ledger schema {LEDGER_SCHEMA_VERSION + 1}, newer"
    ):
        read_ledger(tmp_path)
