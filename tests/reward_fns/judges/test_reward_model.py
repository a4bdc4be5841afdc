"""A sequence-classification reward model as a reward: real scores from a real (tiny) model, in batches, through
the verdict cache, picklable to the processes that train."""

from __future__ import annotations

import pickle

from reward_fns.judges import RewardModel, RewardModelSettings, VerdictCache
from reward_fns.registry import build_reward_functions

PROMPTS = ["What is 6*7?", "Name a colour.", [{"role": "user", "content": "What is 2+2?"}]]
COMPLETIONS = ["42", "Blue, like the sky.", [{"role": "assistant", "content": "4"}]]


def test_scores_are_probabilities_the_same_in_any_batch_size(tiny_reward_model_dir) -> None:
    whole = RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir), batch_size=8))
    one_by_one = RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir), batch_size=1))
    scores = whole(completions=COMPLETIONS, prompts=PROMPTS)
    assert all(0.0 < s < 1.0 for s in scores) and len(set(scores)) == 3  # it reads what it scores
    assert [round(s, 5) for s in one_by_one(completions=COMPLETIONS, prompts=PROMPTS)] == [round(s, 5) for s in scores]
    raw = RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir), normalize="none"))
    assert [round(1 / (1 + 2.718281828459045**-r), 5) for r in raw(completions=COMPLETIONS, prompts=PROMPTS)] == [
        round(s, 5) for s in scores
    ]


def test_the_cache_answers_a_second_time_and_a_changed_model_is_asked_again(tiny_reward_model_dir, tmp_path) -> None:
    cache_path = tmp_path / "verdicts.sqlite3"
    first = RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir)), VerdictCache(cache_path))
    scores = first(completions=COMPLETIONS, prompts=PROMPTS)
    again = pickle.loads(
        pickle.dumps(RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir)), VerdictCache(cache_path)))
    )
    assert again(completions=COMPLETIONS, prompts=PROMPTS) == scores
    assert again.stats.cached == 3 and again.stats.asked == 0 and again._loaded is None  # never loaded the model
    other = RewardModel(
        RewardModelSettings(model=str(tiny_reward_model_dir), normalize="none"), VerdictCache(cache_path)
    )
    other(completions=COMPLETIONS, prompts=PROMPTS)
    assert other.stats.asked == 3


def test_built_from_the_config_as_a_reward_like_the_others(tiny_reward_model_dir) -> None:
    specs = [{"name": "reward_model", "args": {"model": str(tiny_reward_model_dir)}, "weight": 0.5}]
    (reward,), weights = build_reward_functions(specs)
    assert weights == [0.5] and not reward.is_async
    assert len(reward(completions=COMPLETIONS, prompts=PROMPTS)) == 3 and reward.stats.none == 0


def test_two_conversations_with_the_same_last_question_get_their_own_verdicts(tiny_reward_model_dir, tmp_path) -> None:
    """The model reads the whole conversation (the system prompt too), so its verdict is keyed by all of it: a
    cached verdict never answers for another conversation that ends with the same question."""
    question = {"role": "user", "content": "What is 2+2?"}
    french = [{"role": "system", "content": "Answer in French, at length, with a poem."}, question]
    judge = RewardModel(RewardModelSettings(model=str(tiny_reward_model_dir)), VerdictCache(tmp_path / "v.sqlite3"))
    plain, styled = judge(completions=["4", "4"], prompts=[[question], french])
    assert judge.stats.asked == 2 and plain != styled  # two items, two different readings
    assert "Answer in French" in judge.text(french, "4")
