import pytest

from reward_fns.format import boxed_format, tag_count, think_answer_format
from reward_fns.length import length_closeness, repetition_penalty
from reward_fns.registry import REWARD_FUNCTIONS, IsolatedReward, build_reward_functions, check_reward_name


def test_every_builtin_takes_kwargs_and_both_completion_formats() -> None:
    plain = ["\\boxed{4}", "no"]
    chat = [[{"role": "assistant", "content": text}] for text in plain]
    for name, function in REWARD_FUNCTIONS.items():
        a = function(completions=plain, ground_truth=["4", "4"], prompts=["p", "p"], trainer_state=None)
        b = function(completions=chat, ground_truth=["4", "4"], prompts=["p", "p"], trainer_state=None)
        assert a == b and len(a) == 2, name


def test_format_rewards_on_adversarial_text() -> None:
    assert boxed_format(completions=["\\boxed{1}\\boxed{2}", "\\boxed{3}"]) == [0.0, 1.0]
    assert think_answer_format(completions=["<think>a</think><answer>b</answer> trailing"]) == [0.0]
    assert tag_count(completions=["<answer><answer></answer>"]) == [0.25]


def test_length_and_repetition() -> None:
    assert length_closeness(completions=["a" * 30], target_chars=20) == [-10.0]
    assert repetition_penalty(completions=["go " * 50])[0] < -0.9


def test_user_function_by_import_path() -> None:
    functions, weights = build_reward_functions(
        [{"name": "reward_fns.length:length_closeness", "weight": 2.0, "args": {"target_chars": 3}}]
    )
    assert functions[0].__name__ == "length_closeness" and weights == [2.0]
    assert functions[0](completions=["abc", "a"]) == [0.0, -2.0]


def test_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="known: .*math_accuracy"):
        check_reward_name("nope")


def test_a_raising_reward_yields_none_and_is_counted() -> None:
    def flaky(completions, **kwargs):
        raise ZeroDivisionError("boom")

    logged = {}
    reward = IsolatedReward("flaky", flaky)
    assert reward(completions=["a"], log_metric=lambda k, v: logged.__setitem__(k, v)) == [None]
    assert reward.stats.errors == 1 and reward.stats.none_share == 1.0
    assert logged == {"reward_errors/flaky": 1.0, "reward_none/flaky": 1.0}


def test_a_reward_returning_the_wrong_count_is_an_error() -> None:
    reward = IsolatedReward("short", lambda completions, **kwargs: [1.0])
    assert reward(completions=["a", "b"]) == [None, None]
    assert "returned 1 rewards for 2" in reward.stats.last_error


def test_a_reward_over_its_time_budget_judges_nothing_and_training_goes_on() -> None:
    import threading

    released = threading.Event()
    finished = threading.Event()

    def slow(completions, **kwargs):
        released.wait(10)
        finished.set()
        return [1.0] * len(completions)

    reward = IsolatedReward("slow", slow, time_budget_s=0.2)
    assert reward(completions=["a", "b"]) == [None, None]
    assert not finished.is_set()  # the call came back while the function was still running
    assert reward.stats.errors == 1 and "time budget" in reward.stats.last_error
    released.set()
    assert reward(completions=["c"]) == [1.0]  # the next batch runs normally


def test_time_budget_comes_from_the_config() -> None:
    functions, _ = build_reward_functions([{"name": "math_accuracy", "timeout_s": 5}])
    assert functions[0].time_budget_s == 5
    assert functions[0](completions=["\\boxed{2}"], ground_truth=["2"]) == [1.0]
