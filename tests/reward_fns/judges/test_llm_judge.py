"""The LLM judge against an endpoint on loopback: verdicts, the fixed answer form, the cache, the seed, and every
way a judge fails (down, slow, garbage, flaky) turning into None verdicts the pipeline counts, not a crash."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from reward_fns.judges import LLMJudge, LLMJudgeSettings, VerdictCache
from reward_fns.registry import IsolatedReward, build_reward_functions


def _judge(server, cache=None, **settings) -> LLMJudge:
    return LLMJudge(LLMJudgeSettings(url=server.url, model="judge", backoff_s=0.01, **settings), cache)


PROMPTS = ["What is 6*7?", "What is 2+2?", "What is 3*3?"]
COMPLETIONS = ["It is 42.", "It is 5.", "Nine: 9"]
GOLD = ["42", "4", "9"]


def test_pointwise_verdicts_read_the_reference_and_fix_the_answer_form(judge_server) -> None:
    judge = _judge(judge_server)
    verdicts = asyncio.run(judge(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD))
    assert verdicts == [1.0, 0.2, 1.0]
    first = next(r for r in judge_server.requests if "What is 6*7?" in r["messages"][0]["content"])
    assert first["structured_outputs"] == {"choice": [str(s) for s in range(11)]}
    assert "Reference answer:\n42\n" in first["messages"][0]["content"]
    assert judge.stats.requests == 3 and judge.stats.asked == 3 and judge.stats.none == 0


def test_the_judge_reads_the_whole_conversation_and_keys_its_verdict_by_it(judge_server) -> None:
    """A system prompt (or earlier turns) the policy read are the judge's to read too, and part of the verdict's
    key: the same last question under two system prompts is two items."""
    question = {"role": "user", "content": "What is 6*7?"}
    prompts = [[question], [{"role": "system", "content": "Answer in Roman numerals."}, question]]
    asyncio.run(_judge(judge_server)(completions=["XLII", "XLII"], prompts=prompts, ground_truth=["42", "42"]))
    texts = [request["messages"][0]["content"] for request in judge_server.requests]
    assert len(texts) == 2 and sum("System: Answer in Roman numerals.\n\nUser: What is 6*7?" in t for t in texts) == 1


def test_the_same_item_carries_the_same_seed_and_is_asked_once_per_batch(judge_server) -> None:
    judge = _judge(judge_server)
    asyncio.run(judge(completions=["It is 42.", "It is 42."], prompts=[PROMPTS[0]] * 2, ground_truth=["42"] * 2))
    asyncio.run(_judge(judge_server)(completions=["It is 42."], prompts=[PROMPTS[0]], ground_truth=["42"]))
    seeds = [request["seed"] for request in judge_server.requests]
    assert len(seeds) == 2 and seeds[0] == seeds[1]  # one request per distinct item; a new judge, the same seed


def test_cached_verdicts_are_not_asked_again_across_objects_and_processes(judge_server, tmp_path) -> None:
    path = tmp_path / "verdicts.sqlite3"
    first = asyncio.run(
        _judge(judge_server, VerdictCache(path))(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)
    )
    asked = len(judge_server.requests)
    rerun = pickle.loads(pickle.dumps(_judge(judge_server, VerdictCache(path))))  # how a reward reaches a worker
    assert asyncio.run(rerun(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)) == first
    assert len(judge_server.requests) == asked and rerun.stats.cached == 3 and rerun.stats.requests == 0
    other_rubric = _judge(judge_server, VerdictCache(path), rubric="Only brevity counts.")
    asyncio.run(other_rubric(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD))
    assert len(judge_server.requests) == asked + 3  # another rubric is another judge: asked again


def test_a_judge_that_is_down_gives_none_after_its_retries(judge_server) -> None:
    url = judge_server.url.replace(judge_server.url.rsplit(":", 1)[1].split("/")[0], "9")  # nothing listens on 9
    judge = LLMJudge(LLMJudgeSettings(url=url, model="judge", max_retries=2, backoff_s=0.01))
    reward = IsolatedReward("llm_judge", judge, time_budget_s=30)
    assert reward(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD) == [None, None, None]
    assert judge.stats.requests == 9 and "ConnectError" in judge.stats.last_error
    assert reward.stats.none == 3 and reward.stats.errors == 0


def test_a_slow_judge_is_cut_at_its_deadline_and_a_hung_one_at_the_reward_budget(judge_server) -> None:
    judge_server.mode, judge_server.delay_s = "slow", 3.0
    judge = _judge(judge_server, deadline_s=0.5)
    started = time.perf_counter()
    assert asyncio.run(judge(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)) == [None] * 3
    assert time.perf_counter() - started < 2.5 and "deadline" in judge.stats.last_error
    reward = IsolatedReward("llm_judge", _judge(judge_server), time_budget_s=0.5)
    started = time.perf_counter()
    assert reward(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD) == [None] * 3
    assert time.perf_counter() - started < 2.5 and "time budget" in reward.stats.last_error


@pytest.mark.parametrize("mode", ["garbage", "html"])
def test_an_answer_that_cannot_be_read_is_none_not_a_guess(judge_server, mode: str) -> None:
    judge_server.mode = mode
    judge = _judge(judge_server)
    assert asyncio.run(judge(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)) == [None] * 3
    assert judge.stats.requests == 3  # an answer is not retried: the server answered


def test_a_flaky_judge_is_retried_with_backoff(judge_server) -> None:
    judge_server.mode, judge_server.failures_left = "flaky", 2
    judge = _judge(judge_server, max_concurrency=1)
    assert asyncio.run(judge(completions=COMPLETIONS[:1], prompts=PROMPTS[:1], ground_truth=GOLD[:1])) == [1.0]
    assert judge.stats.requests == 3


def test_pairwise_asks_both_orders_and_a_position_bias_splits_the_verdict(judge_server) -> None:
    kwargs = {"completions": ["a good answer", "a poor answer"], "prompts": ["Q"] * 2}
    kwargs["reference_completion"] = ["a plain answer"] * 2
    judge = _judge(judge_server, mode="pairwise")
    assert asyncio.run(judge(**kwargs)) == [1.0, 0.0]
    assert [r["structured_outputs"] for r in judge_server.requests[:1]] == [{"choice": ["A", "B"]}]
    assert len(judge_server.requests) == 4 and judge.stats.split == 0
    judge_server.answer = lambda payload: "A"  # a judge that always prefers the first position
    biased = _judge(judge_server, mode="pairwise")
    assert asyncio.run(biased(**kwargs)) == [0.5, 0.5] and biased.stats.split == 2
    with pytest.raises(ValueError, match="reference_completion"):
        asyncio.run(judge(completions=["x"], prompts=["Q"]))


def test_the_reward_wrapper_awaits_an_async_judge_instead_of_returning_coroutines(judge_server) -> None:
    """Without its async path every verdict would be a coroutine, read as None."""
    specs = [{"name": "llm_judge", "args": {"url": judge_server.url, "model": "judge"}, "timeout_s": 30}]
    (reward,), _ = build_reward_functions(specs)
    assert reward.is_async and reward.__name__ == "llm_judge"
    assert reward(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD) == [1.0, 0.2, 1.0]

    async def inside_a_running_loop():  # Prefect and notebooks call from an event loop
        return reward(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)

    assert asyncio.run(inside_a_running_loop()) == [1.0, 0.2, 1.0]


def test_judge_args_are_checked_when_the_config_loads() -> None:
    from tasks.config import RewardSpec

    with pytest.raises(ValueError, match="llm_judge args: url: Field required; temprature: Extra inputs"):
        RewardSpec(name="llm_judge", args={"model": "j", "temprature": 0.5})
    with pytest.raises(ValueError, match="pairwise judge's template needs {first}, {second}"):
        RewardSpec(name="llm_judge", args={"url": "u", "model": "j", "mode": "pairwise", "template": "{completion}"})


def test_the_expected_score_weighs_the_scores_the_judge_gave_probability(judge_server) -> None:
    """G-Eval's weighting: the answer at 0.75 and the farthest score at 0.25 give 0.75 × answer + 0.25 × other."""
    judge_server.answer = lambda payload: "9" if "Reference answer:\n42\n" in payload["messages"][0]["content"] else "3"
    judge = _judge(judge_server, score="expected", max_score=9)
    verdicts = asyncio.run(judge(completions=COMPLETIONS[:2], prompts=PROMPTS[:2], ground_truth=GOLD[:2]))
    assert [round(v, 4) for v in verdicts] == [round(0.75 * 1 + 0.25 * 0, 4), round((0.75 * 3 + 0.25 * 9) / 9, 4)]
    assert all(r["top_logprobs"] == 20 and r["max_tokens"] == 1 for r in judge_server.requests)
    with pytest.raises(ValueError, match="max_score must be 9 or less"):
        LLMJudgeSettings(url="u", model="m", score="expected")


def test_the_judge_takes_its_key_from_a_file_or_an_allowed_variable(judge_server, tmp_path, monkeypatch) -> None:
    judge_server.api_key = "judge-key-93c1"
    without = _judge(judge_server, max_retries=0)
    assert asyncio.run(without(completions=COMPLETIONS[:1], prompts=PROMPTS[:1], ground_truth=GOLD[:1])) == [None]
    assert without.stats.last_error.startswith("HTTP 401")
    (tmp_path / "key").write_text("judge-key-93c1\n")
    from_file = _judge(judge_server, api_key_file=str(tmp_path / "key"))
    assert asyncio.run(from_file(completions=COMPLETIONS, prompts=PROMPTS, ground_truth=GOLD)) == [1.0, 0.2, 1.0]
    monkeypatch.setenv("GRPOFLOW_JUDGE_API_KEY_FILE", str(tmp_path / "key"))  # <NAME>_FILE where <NAME> is unset
    from_variable_file = _judge(judge_server, api_key_env="GRPOFLOW_JUDGE_API_KEY")
    assert asyncio.run(from_variable_file(completions=COMPLETIONS[:1], prompts=PROMPTS[:1], ground_truth=GOLD[:1])) == [
        1.0
    ]
    monkeypatch.delenv("GRPOFLOW_JUDGE_API_KEY_FILE")
    with pytest.raises(ValueError, match="GRPOFLOW_JUDGE_API_KEY .*is not set"):
        _judge(judge_server, api_key_env="GRPOFLOW_JUDGE_API_KEY")
    with pytest.raises(ValueError, match="api_key_file .*missing"):
        _judge(judge_server, api_key_file=str(tmp_path / "missing"))


def test_judge_keys_stay_where_they_belong_at_load() -> None:
    from tasks.config import RewardSpec

    with pytest.raises(ValueError, match="api_key_env 'HOME' is not one of GRPOFLOW_JUDGE_API_KEY"):
        RewardSpec(name="llm_judge", args={"url": "https://j/v1", "model": "j", "api_key_env": "HOME"})
    with pytest.raises(ValueError, match="one way: api_key_env or api_key_file"):
        RewardSpec(
            name="llm_judge",
            args={"url": "https://j/v1", "model": "j", "api_key_env": "VLLM_API_KEY", "api_key_file": "/k"},
        )
    with pytest.raises(ValueError, match="plain http to judge.internal: use https"):
        RewardSpec(name="llm_judge", args={"url": "http://judge.internal/v1", "model": "j", "api_key_file": "/k"})
    for allowed in (
        {"url": "https://judge.internal/v1", "api_key_file": "/k"},
        {"url": "http://127.0.0.1:8001/v1", "api_key_env": "VLLM_API_KEY"},
        {"url": "http://judge.internal/v1", "api_key_file": "/k", "allow_key_over_http": True},
        {"url": "http://judge.internal/v1"},  # no key, nothing to leak
    ):
        RewardSpec(name="llm_judge", args={"model": "j", **allowed})


def test_credentials_in_a_judge_url_are_never_shown(judge_server) -> None:
    judge_server.api_key = "needs-a-key"
    url = judge_server.url.replace("http://", "http://ann:url-pass-77@")
    judge = LLMJudge(LLMJudgeSettings(url=url, model="judge", max_retries=0))
    asyncio.run(judge(completions=COMPLETIONS[:1], prompts=PROMPTS[:1], ground_truth=GOLD[:1]))
    assert judge.stats.last_error.startswith("HTTP 401") and "url-pass-77" not in judge.stats.last_error
    assert "url-pass-77" not in str(judge.identity)
    down = LLMJudge(LLMJudgeSettings(url="http://ann:url-pass-77@127.0.0.1:9/v1", model="judge", max_retries=0))
    asyncio.run(down(completions=COMPLETIONS[:1], prompts=PROMPTS[:1], ground_truth=GOLD[:1]))
    assert down.stats.last_error and "url-pass-77" not in down.stats.last_error


def test_on_a_network_filesystem_each_host_keeps_its_own_verdict_file_without_wal(tmp_path) -> None:
    """SQLite's WAL is unsafe when several hosts open one file (a cluster's home on NFS): there the cache is a file
    of this host's own, in rollback-journal mode; on a local disk the one shared file in WAL mode."""
    import pickle
    import socket
    import sqlite3

    from reward_fns.judges.cache import verdict_cache_file

    mounts = f"1 0 0:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:2 / {tmp_path / 'home'} rw - nfs4 server:/home rw\n"
    local, local_wal = verdict_cache_file(tmp_path / "disk" / "verdicts", mounts)
    shared, shared_wal = verdict_cache_file(tmp_path / "home" / "ann" / "verdicts", mounts)
    assert (local.name, local_wal) == ("verdicts.sqlite3", True)
    assert shared.name == f"verdicts-{socket.gethostname()}.sqlite3" and not shared_wal
    for path, wal in ((local, local_wal), (shared, shared_wal)):
        cache = VerdictCache(path, wal=wal)
        cache.put_many({"k": 0.5})
        again = pickle.loads(pickle.dumps(cache))  # a rank reopens it the same way
        assert again.get_many(["k"]) == {"k": 0.5}
        mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == ("wal" if wal else "delete")
        cache.close()
        again.close()
