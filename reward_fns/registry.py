"""Reward functions by name, user functions by import path, and the isolation wrapper TRL calls.

Must not import: Prefect, MLflow, torch, ``tasks`` (the config's reward specs arrive as plain objects).

>>> funcs, weights = build_reward_functions([{"name": "math_accuracy"}, {"name": "boxed_format", "weight": 0.2}])
>>> [f.__name__ for f in funcs], weights
(['math_accuracy', 'boxed_format'], [1.0, 0.2])
>>> funcs[0](completions=[r"\\boxed{3}"], ground_truth=["3"])
[1.0]
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reward_fns.code import code_passes, code_tests
from reward_fns.format import boxed_format, tag_count, think_answer_format
from reward_fns.json_schema import json_match, json_schema
from reward_fns.judges import JUDGES, VerdictCache, build_judge
from reward_fns.label import exact_match, label_match
from reward_fns.length import length_closeness, repetition_penalty
from reward_fns.math import boxed_match, load_math_verify, math_accuracy

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., list[float | None]]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "boxed_match": boxed_match,
    "boxed_format": boxed_format,
    "think_answer_format": think_answer_format,
    "tag_count": tag_count,
    "length_closeness": length_closeness,
    "repetition_penalty": repetition_penalty,
    "exact_match": exact_match,
    "label_match": label_match,
    "json_schema": json_schema,
    "json_match": json_match,
    "code_tests": code_tests,
    "code_passes": code_passes,
}

# Which reward decides "correct" for pass@k and promotion, per task kind.
CORRECTNESS_REWARD: dict[str, str] = {
    "math": "math_accuracy",
    "exact": "exact_match",
    "label": "label_match",
    "json": "json_match",
    "code": "code_passes",
}


def reward_columns(rows: Sequence[Mapping[str, Any]], repeat: int = 1) -> dict[str, list[Any]]:
    """Every column of the rows but the prompt, each value repeated ``repeat`` times (once per completion): what
    TRL hands reward functions as keyword arguments, and what evaluation hands them too. A column of one scalar
    type keeps its values; any other holds text (JSON for objects such as schemas), as a dataset needs one type
    per column.

    >>> reward_columns([{"prompt": "p", "ground_truth": "4", "difficulty": 2, "schema": {"type": "integer"}}])
    {'ground_truth': ['4'], 'difficulty': [2], 'schema': ['{"type": "integer"}']}
    """
    names = list(dict.fromkeys(key for row in rows for key in row if key != "prompt"))
    columns: dict[str, list[Any]] = {}
    for name in names:
        values = [row.get(name) for row in rows]
        kinds = {type(v) for v in values if v is not None}
        if len(kinds) > 1 or not kinds <= {str, int, float, bool}:
            values = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
        columns[name] = [value for value in values for _ in range(repeat)]
    return columns


def check_reward_name(name: str) -> None:
    """Raise ValueError for a name that is neither built in (a function or a judge: ``llm_judge``,
    ``reward_model``) nor an importable ``module:function`` path."""
    if name in REWARD_FUNCTIONS or name in JUDGES:
        return
    if ":" in name:
        module, _, attribute = name.partition(":")
        if module and attribute.isidentifier():
            return
    known = ", ".join(sorted([*REWARD_FUNCTIONS, *JUDGES]))
    raise ValueError(f"unknown reward function {name!r}; known: {known}; or give 'package.module:function'")


def resolve_reward(name: str, path: str | Path | None = None) -> RewardFunction:
    """The function behind a built-in name or an import path such as ``my_pkg.rewards:score``; ``path`` (a
    folder) is put on ``sys.path`` first."""
    check_reward_name(name)
    if name in JUDGES:
        raise ValueError(f"{name} is a judge: it is built from its args (build_reward_functions), not imported")
    if name in REWARD_FUNCTIONS:  # looked up in its module now, so a patched or reloaded module is what runs
        function = REWARD_FUNCTIONS[name]
        return getattr(sys.modules.get(function.__module__), function.__name__, function)
    if path is not None and str(path) not in sys.path:
        sys.path.append(str(path))
    module_name, _, attribute = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward function {name!r} cannot be imported: {exc}") from exc
    if not callable(function):
        raise ValueError(f"reward function {name!r} is not callable")
    return function


@dataclass
class RewardStats:
    """Counts kept across calls so a stage can report and limit ``None`` verdicts and errors."""

    scored: int = 0
    none: int = 0
    errors: int = 0
    seconds: float = 0.0
    last_error: str | None = field(default=None, repr=False)

    @property
    def none_share(self) -> float:
        return self.none / self.scored if self.scored else 0.0


class IsolatedReward:
    """Wraps a reward function: binds its arguments, turns an exception or an exceeded time budget into ``None``
    verdicts, counts both.

    TRL names the metric after ``__name__``, so the wrapper carries the configured name.

    >>> def broken(completions, **kwargs): raise RuntimeError("bug")
    >>> reward = IsolatedReward("broken", broken)
    >>> reward(completions=["a", "b"]), reward.stats.errors, reward.stats.none
    ([None, None], 1, 2)
    """

    def __init__(
        self,
        name: str,
        function: RewardFunction,
        args: Mapping[str, Any] | None = None,
        time_budget_s: float | None = None,
    ) -> None:
        self.__name__ = name
        self.function = function
        self.args = dict(args or {})
        self.time_budget_s = time_budget_s
        self.stats = RewardStats()
        self.last_batch: dict[str, list[Any]] = {}
        call = getattr(function, "__call__", None)  # noqa: B004 - a judge object's async __call__ counts too
        self.is_async = inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)

    def _call(self, completions: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """The function's rewards; an async function (a judge) runs to its end in an event loop of its own, and
        with a time budget it is cancelled at the budget (its requests with it)."""
        result = self.function(completions=completions, **kwargs)
        if inspect.isawaitable(result):

            async def bounded() -> Any:
                return await asyncio.wait_for(result, self.time_budget_s)

            result = asyncio.run(bounded())
        return list(result)

    def _run(self, completions: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Call the function; with a time budget (or when it is async), in a daemon thread that is abandoned when
        the budget runs out (a thread cannot be killed, and a hung call must hold up neither training nor the
        process's exit). Works off the main thread, unlike SIGALRM-based timeouts, and beside a running event loop.
        """
        if self.time_budget_s is None and not self.is_async:
            return self._call(completions, kwargs)
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["rewards"] = self._call(completions, kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = exc

        worker = threading.Thread(target=call, name=f"reward-{self.__name__}", daemon=True)
        worker.start()
        # An async reward is cancelled inside its loop at the budget; the join waits a little longer for that.
        worker.join(None if self.time_budget_s is None else self.time_budget_s + (5 if self.is_async else 0))
        if worker.is_alive():
            raise TimeoutError(f"exceeded its time budget of {self.time_budget_s:g} s")
        if isinstance(outcome.get("error"), TimeoutError | asyncio.TimeoutError):
            raise TimeoutError(f"exceeded its time budget of {self.time_budget_s:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["rewards"]

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        started = time.perf_counter()
        try:
            rewards = self._run(completions, {**kwargs, **self.args})
            if len(rewards) != len(completions):
                raise ValueError(f"returned {len(rewards)} rewards for {len(completions)} completions")
            judge_error = getattr(getattr(self.function, "stats", None), "last_error", None)
            if judge_error and any(r is None for r in rewards):
                self.stats.last_error = judge_error  # a judge answers None itself: its reason, for the None guard
        except Exception as exc:  # a user's reward must not stop training: count it and judge nothing
            self.stats.errors += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            logger.warning("reward %s failed on a batch of %d: %s", self.__name__, len(completions), exc)
            rewards = [None] * len(completions)
        self.stats.seconds += time.perf_counter() - started
        self.stats.scored += len(rewards)
        self.stats.none += sum(r is None for r in rewards)
        self.last_batch = {
            "prompts": list(kwargs.get("prompts") or []),
            "completions": list(completions),
            "rewards": rewards,
        }
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric(f"reward_errors/{self.__name__}", float(self.stats.errors))
            log_metric(f"reward_none/{self.__name__}", self.stats.none_share)
        return [None if r is None else float(r) for r in rewards]


def build_reward_functions(
    specs: Sequence[Any], verdict_cache: VerdictCache | None = None
) -> tuple[list[IsolatedReward], list[float]]:
    """Reward callables and their weights from config specs (``RewardSpec`` objects or plain dicts); judges
    (``llm_judge``, ``reward_model``) are built from their ``args`` and share ``verdict_cache``."""
    functions: list[IsolatedReward] = []
    weights: list[float] = []
    # math-verify is imported at first use; here, in the caller's thread, not inside a reward call's time budget
    # (its import takes about a second the first time, and a budget would count it as the call's).
    load_math_verify()
    for spec in specs:
        item = spec if isinstance(spec, Mapping) else spec.model_dump()
        name = item["name"]
        label = name.rsplit(":", 1)[-1]
        if name in JUDGES:  # its args are its settings, not keyword arguments of each call
            judge = build_judge(name, item.get("args") or {}, verdict_cache)
            functions.append(IsolatedReward(label, judge, {}, item.get("timeout_s")))
        else:
            function = resolve_reward(name, item.get("path"))
            functions.append(IsolatedReward(label, function, item.get("args") or {}, item.get("timeout_s")))
        weights.append(float(item.get("weight", 1.0)))
    return functions, weights
