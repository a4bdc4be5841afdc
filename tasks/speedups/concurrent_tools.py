"""GRPO's tool calls side by side across a batch's rollouts (TRL 1.16's tool loop runs them one after another).

TRL's ``_tool_call_loop`` answers a round's calls rollout by rollout, calling each rollout's sync tools from
``self._sync_tool_dicts[i]``, so a batch waits for the sum of its calls (the sandbox's workers idle; a slow tool
holds every rollout behind it). ``ConcurrentToolCallsMixin`` leaves the loop as TRL wrote it and swaps those dicts,
for the loop's duration, for ``RoundOfCalls`` proxies: at a round's first call, every rollout's pending calls (the
calls of its last assistant message, not yet answered) start in a thread pool, each rollout's own calls in order,
up to ``tools.concurrent_calls`` rollouts at once; TRL's loop then reads each answer (or the exception the tool
raised, raised again) in its own order. A call that is not the one expected runs as TRL would have run it.

The seam is private (``_tool_call_loop``, ``_sync_tool_dicts``): checked on TRL 1.16; where it is missing the
mixin changes nothing and TRL's own sequential loop runs. Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


def pending_calls(message: Any, tools: dict[str, Callable[..., Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The ``(name, arguments)`` of the calls in an assistant ``message`` that go to one of ``tools`` (TRL answers
    other calls itself: unknown names, unsupported types, async tools).

    >>> call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    >>> other = {"type": "function", "function": {"name": "nope", "arguments": {}}}
    >>> pending_calls({"role": "assistant", "tool_calls": [call, other]}, {"add": print})
    [('add', {'a': 1})]
    >>> pending_calls({"role": "tool", "content": "2"}, {"add": print})
    []
    """
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return []
    found = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if call.get("type") == "function" else {}
        name = function.get("name")
        if name in tools:
            found.append((name, function.get("arguments", {})))
    return found


class RoundOfCalls:
    """One tool loop's batch: at each round's first call, every rollout's pending calls start side by side; each
    call then returns what its rollout's run gave it."""

    def __init__(self, completions: list, tool_dicts: list[dict[str, Callable[..., Any]]], workers: int) -> None:
        self.completions, self.tool_dicts, self.workers = completions, tool_dicts, workers
        self.answered: set[int] = set()  # id() of the assistant messages whose calls were started
        self.queues: dict[int, collections.deque] = {}

    def proxies(self) -> list[dict[str, Callable[..., Any]]]:
        """The tool dicts TRL's loop calls through, one per rollout, the same names."""
        return [{name: self._proxy(index, name) for name in tools} for index, tools in enumerate(self.tool_dicts)]

    def _proxy(self, index: int, name: str) -> Callable[..., Any]:
        def call(**arguments: Any) -> Any:
            return self.answer(index, name, arguments)

        return call

    def answer(self, index: int, name: str, arguments: dict[str, Any]) -> Any:
        if not any(self.queues.values()):
            self._start_round()
        queue = self.queues.get(index)
        if not queue or queue[0][:2] != (name, arguments):
            return self.tool_dicts[index][name](**arguments)  # not a call this round started: as TRL runs it
        _, _, future, position = queue.popleft()
        outcome = future.result()[position]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _start_round(self) -> None:
        rounds = {}
        for index, messages in enumerate(self.completions):
            last = messages[-1] if messages else None
            if last is None or id(last) in self.answered:
                continue
            calls = pending_calls(last, self.tool_dicts[index])
            if calls:
                self.answered.add(id(last))
                rounds[index] = calls
        if not rounds:
            return
        with ThreadPoolExecutor(min(self.workers, len(rounds)), thread_name_prefix="grpoflow-calls") as pool:
            futures = {index: pool.submit(self._run, index, calls) for index, calls in rounds.items()}
        self.queues = {
            index: collections.deque(
                (name, arguments, futures[index], position) for position, (name, arguments) in enumerate(calls)
            )
            for index, calls in rounds.items()
        }

    def _run(self, index: int, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        """A rollout's calls in order; each one's answer or the exception it raised."""
        outcomes: list[Any] = []
        for name, arguments in calls:
            try:
                outcomes.append(self.tool_dicts[index][name](**arguments))
            except Exception as error:  # noqa: BLE001 - raised again where TRL's loop reads it
                outcomes.append(error)
        return outcomes


def concurrency_of(tool_dicts: list[dict[str, Callable[..., Any]]]) -> int:
    """``tools.concurrent_calls`` of the rollouts' environments (grpoflow's ``RolloutTools``); 1 for others."""
    for tools in tool_dicts:
        for function in tools.values():
            settings = getattr(getattr(function, "__self__", None), "_settings", None)
            if settings is not None:
                return int(getattr(settings, "concurrent_calls", 1))
    return 1


class ConcurrentToolCallsMixin:
    """Trainer mixin: TRL's tool loop with each round's calls started side by side (``RoundOfCalls``)."""

    def _tool_call_loop(self, prompts: Any, prompt_ids: Any, completion_ids: Any, completions: Any, *rest: Any) -> Any:
        originals = getattr(self, "_sync_tool_dicts", None)
        workers = concurrency_of(originals) if isinstance(originals, list) else 1
        if workers <= 1 or len(originals) <= 1:
            return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, *rest)  # type: ignore[misc]
        self._sync_tool_dicts = RoundOfCalls(completions, originals, workers).proxies()
        try:
            return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, *rest)  # type: ignore[misc]
        finally:
            self._sync_tool_dicts = originals
