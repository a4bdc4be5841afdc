"""The learning-signal guards: the online difficulty filter inside a real TRL GRPO run, the early stops, and the
filter's state across a resume."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.config import SignalStopSettings, load_config
from tasks.training import SIGNAL_STATE_FILE, SignalStop, load_signal_state

# Prompts whose arithmetic answer is even are "solved" by every sample (reward 1 everywhere: no signal); the
# others score by completion length, which differs between samples (signal).
SPLIT_REWARD = """
def half_solved(completions, ground_truth, **kwargs):
    out = []
    for completion, gold in zip(completions, ground_truth):
        if int(gold) % 2 == 0:
            out.append(1.0)
        else:
            out.append(min(len(completion), 12) / 13)
    return out
"""


@pytest.fixture
def split_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "split_reward.py").write_text(SPLIT_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("split_reward", None)
    return "split_reward:half_solved"


def _grpo(config, tiny_split, tiny_model_dir, stage_dir):
    from tasks.grpo import run_grpo

    return run_grpo(config, tiny_split.train_path, tiny_model_dir, None, stage_dir)


def test_filter_replaces_uninformative_groups_and_retires_solved_prompts(
    tiny_config, tiny_split, tiny_model_dir, split_reward, tmp_path
) -> None:
    overrides = {
        "rewards": [{"name": split_reward}],
        "grpo.max_steps": 4,
        "grpo.checkpoint_steps": 2,
        "grpo.batch_size": 16,  # 4 groups of 4 per step
        "grpo.dynamic_sampling": {"enabled": True, "max_oversample": 3.0, "retire_after": 1},
    }
    config = load_config(Path("configs/tiny.yaml"), {**overrides, "output_dir": str(tmp_path / "out")})
    result = _grpo(config, tiny_split, tiny_model_dir, tmp_path / "grpo")
    steps = [entry for entry in result.history if "signal/informative_after" in entry]
    assert len(steps) == 4
    # about half the prompts carry signal; the filter samples others on top and fills the batch with those
    assert all(entry["signal/informative_after"] == 1.0 for entry in steps)
    assert all(entry["frac_reward_zero_std"] == 0.0 for entry in steps)  # what the loss trained on
    assert sum(entry["signal/informative_before"] for entry in steps) / len(steps) < 0.9
    assert sum(entry["signal/extra_prompts"] for entry in steps) > 0
    assert steps[-1]["signal/prompts_retired"] >= 2  # even-answer prompts leave the pool after one solved visit
    saved = load_signal_state(tmp_path / "grpo" / "checkpoints" / "checkpoint-4", retire_after=1)
    assert saved.retired and all(key.strip() for key in saved.retired)
    assert (tmp_path / "grpo" / "checkpoints" / "checkpoint-2" / SIGNAL_STATE_FILE).is_file()

    longer = load_config(Path("configs/tiny.yaml"), {**overrides, "grpo.max_steps": 6, "output_dir": str(tmp_path)})
    resumed = _grpo(longer, tiny_split, tiny_model_dir, tmp_path / "grpo")  # resumes from checkpoint-4
    after = [entry for entry in resumed.history if "signal/prompts_retired" in entry and entry["step"] > 4]
    assert [entry["step"] for entry in after] == [5.0, 6.0]
    assert after[0]["signal/prompts_retired"] >= len(saved.retired)  # the pool went on from the checkpoint's


def _logs(**values):
    return values


def _feed(stop: SignalStop, entries: list[dict]) -> list[int]:
    stopped = []
    for step, logs in enumerate(entries, start=1):
        control = SimpleNamespace(should_training_stop=False)
        stop.on_log(None, SimpleNamespace(global_step=step), control, logs=logs)
        if control.should_training_stop:
            stopped.append(step)
    return stopped


def test_entropy_collapse_and_reward_plateau_stop_with_their_numbers() -> None:
    collapse = SignalStop(SignalStopSettings(entropy_floor=0.05, entropy_steps=3))
    entries = [_logs(entropy=e, frac_reward_zero_std=0.2) for e in (0.9, 0.04, 0.03, 0.2, 0.01, 0.02, 0.01)]
    assert _feed(collapse, entries) == [7]  # three low steps in a row; the recovery at step 4 reset the count
    assert collapse.verdict.cause == "entropy_collapse" and collapse.verdict.numbers["entropy"] == 0.01

    plateau = SignalStop(SignalStopSettings(plateau_steps=3, plateau_window=2, plateau_min_delta=0.05))
    rewards = [0.1, 0.2, 0.4, 0.6, 0.62, 0.6, 0.61, 0.63, 0.6]  # 2-step means: .15 .3 .5 .61 .61 .605 .62 .615
    assert _feed(plateau, [_logs(reward=r) for r in rewards]) == [8]  # best .61 at step 5, no gain of .05 since
    assert plateau.verdict.cause == "reward_plateau" and "plateau" in plateau.verdict.message

    off = SignalStop(SignalStopSettings(dead_signal_steps=0, entropy_steps=0))
    assert _feed(off, [_logs(frac_reward_zero_std=1.0, entropy=0.0)] * 20) == []


def test_replayed_history_rebuilds_the_counters_without_stopping() -> None:
    stop = SignalStop(SignalStopSettings(dead_signal_steps=3))
    for step in (1, 2):  # what a resumed run replays from its checkpoint
        stop.on_log(None, SimpleNamespace(global_step=step), None, logs={"frac_reward_zero_std": 1.0})
    assert stop.verdict is None
    assert _feed(stop, [_logs(frac_reward_zero_std=1.0)]) == [1]
    assert stop.verdict.cause == "dead_signal" and stop.verdict.numbers["steps"] == 3
