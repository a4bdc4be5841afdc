"""GRPO's tool calls side by side: ``RoundOfCalls`` read in the order TRL's tool loop reads them (rollout by
rollout, each rollout's calls in order), over tools that count how many of them run at once."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.speedups.concurrent_tools import RoundOfCalls


class Counted:
    """Tools for one rollout that record every call and how many calls (of every rollout) run at once."""

    running = {"now": 0, "most": 0}
    lock = threading.Lock()

    def __init__(self) -> None:
        self.calls: list[str] = []

    def slow(self, text: str) -> str:
        with self.lock:
            self.running["now"] += 1
            self.running["most"] = max(self.running["most"], self.running["now"])
        time.sleep(0.2)
        with self.lock:
            self.running["now"] -= 1
        self.calls.append(text)
        return text.upper()

    def fail(self, text: str) -> str:
        self.calls.append(text)
        raise ValueError(f"no {text}")


def _call(name: str, text: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"text": text}}}


def _trl_round(completions: list, tool_dicts: list, indices: list[int]) -> list[list]:
    """What TRL's loop does with a round: each rollout's calls, in order, answers or the error's text."""
    answers = []
    for index in indices:
        got = []
        for call in completions[index][-1]["tool_calls"]:
            function = call["function"]
            try:
                got.append(tool_dicts[index][function["name"]](**function["arguments"]))
            except Exception as error:  # noqa: BLE001 - as TRL answers it
                got.append(f"error: {error}")
        answers.append(got)
    return answers


@pytest.mark.parametrize("workers", [1, 4])
def test_a_rounds_calls_run_side_by_side_and_each_rollout_reads_its_own_answers_in_order(workers: int) -> None:
    Counted.running.update(now=0, most=0)
    tools = [Counted() for _ in range(4)]
    originals = [{"slow": t.slow, "fail": t.fail} for t in tools]
    completions = [
        [
            {
                "role": "assistant",
                "tool_calls": [_call("slow", f"r{i}a"), _call("fail", f"r{i}b"), _call("slow", f"r{i}c")],
            }
        ]
        for i in range(4)
    ]
    completions[3] = [{"role": "assistant", "content": "no call"}]  # a rollout without calls this round
    batch = RoundOfCalls(completions, originals, workers)
    answers = _trl_round(completions, batch.proxies(), [0, 1, 2])
    assert answers == [[f"R{i}A", f"error: no r{i}b", f"R{i}C"] for i in range(3)]
    assert [t.calls for t in tools] == [[f"r{i}a", f"r{i}b", f"r{i}c"] for i in range(3)] + [[]]
    assert Counted.running["most"] == (1 if workers == 1 else 3)

    # The next round: rollout 0 answered and called again, rollout 1 was rolled back (its last message is the one
    # already answered: not run twice), rollout 2 finished.
    completions[0] += [{"role": "tool", "content": "R0A"}, {"role": "assistant", "tool_calls": [_call("slow", "r0d")]}]
    completions[2] += [{"role": "tool", "content": "R2A"}, {"role": "assistant", "content": "done"}]
    assert _trl_round(completions, batch.proxies(), [0]) == [["R0D"]]
    assert tools[0].calls[-1] == "r0d" and tools[1].calls == ["r1a", "r1b", "r1c"]
