"""Multi-turn sampling with tools for probe and evaluation (and GRPO's in-training hold-out): grpoflow's counterpart
of TRL's tool loop (``GRPOTrainer._tool_call_loop``), over either engine's token ids (``sample_ids``), so a model
is scored the way GRPO rolls it out.

Each rollout gets its own environment (``tasks.environments.Toolbox.factory``; ``reset`` with the row, its answer
added to the last user message, as TRL does). A completion is parsed with TRL's ``parse_response``; its tool calls
run (a call that raises answers ``{'error': ...}``), the answers are rendered by the template and appended as ids
(no re-tokenization of what came before), and the model continues, one sample per conversation, for at most
``tools.max_turns`` rounds. As in TRL, tool answers count toward the completion budget (``max_new_tokens``): a round
whose answers would pass it, or the context length, is dropped and the rollout ends with the turn before it.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tasks.environments import RolloutTools, Toolbox, ToolTemplate, error_answer, record_json, tool_methods
from tasks.environments import tool_suffix_ids as suffix_ids_of

# Each round after the first draws from its own seed, apart from the first round's batches.
ROUND_SEED_STRIDE = 7919


class Conversation(list):
    """A tool-using completion as TRL hands it to rewards (a list of messages: assistant turns and tool answers),
    with the calls its rollout's environment recorded (``calls``: plain dicts) and its token counts."""

    def __init__(self, messages: Sequence[dict[str, Any]] = (), calls: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(messages)
        self.calls = list(calls)

    def to_json(self) -> dict[str, Any]:
        return {"messages": list(self), "calls": self.calls}

    @classmethod
    def from_json(cls, data: Any) -> Any:
        """A conversation from ``to_json``'s form; anything else (a plain completion's text) as it is.

        >>> Conversation.from_json({"messages": [{"role": "assistant", "content": "4"}], "calls": []})
        [{'role': 'assistant', 'content': '4'}]
        >>> Conversation.from_json("4")
        '4'
        """
        if isinstance(data, dict) and "messages" in data:
            return cls(data["messages"], data.get("calls", []))
        return data


@dataclass(frozen=True)
class ToolPrompt:
    """A prompt for tool use: the conversation so far (messages, system prompt included) and its row (the keyword
    arguments of an environment's ``reset``)."""

    messages: list[dict[str, Any]]
    row: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """The prompt's identity in caches."""
        return json.dumps(self.messages, sort_keys=True, default=str)


@dataclass
class _Rollout:
    prompt_ids: list[int]
    environment: RolloutTools
    tools: list[Callable[..., Any]]
    completion_ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


class ToolSampler:
    """A sampler whose rollouts may call the pipeline's tools: the engine sampler it wraps (``inner``, whose
    tokenizer renders with the tool template) samples every turn. ``without_tools`` is that engine sampler alone,
    for scoring the same model without its tools."""

    def __init__(self, inner: Any, toolbox: Toolbox, template: ToolTemplate, max_turns: int, context: int) -> None:
        self.inner, self.toolbox, self.template = inner, toolbox, template
        self.max_turns, self.context = max_turns, context
        self.concurrent_calls = toolbox.settings.concurrent_calls
        self.tokenizer = inner.tokenizer
        self.backend = inner.backend

    @property
    def without_tools(self) -> Any:
        return self.inner

    def identity(self) -> dict[str, str]:
        """What the tools add to a cache key: the tools (schemas, limits) and the template."""
        return {"tools": self.toolbox.digest(), "template": self.template.digest, "max_turns": str(self.max_turns)}

    def prompt_of(self, row: dict[str, Any], system_prompt: str | None) -> ToolPrompt:
        from tasks.inputs import prompt_messages

        return ToolPrompt(prompt_messages(row["prompt"], system_prompt), dict(row))

    def sample(
        self,
        prompts: Sequence[ToolPrompt],
        *,
        n: int = 1,
        temperature: float = 1.0,
        max_new_tokens: int = 32,
        seed: int = 0,
        greedy: bool = False,
        progress: Callable[[int, int], None] | None = None,
        stats: Any = None,
    ) -> list[list[Conversation]]:
        """``n`` tool-using rollouts per prompt (greedy: one), in prompt order, each a ``Conversation``."""
        samples = 1 if greedy else n
        rollouts = [[self._start(prompt) for _ in range(samples)] for prompt in prompts]
        common = {"temperature": temperature, "max_new_tokens": max_new_tokens, "greedy": greedy, "stats": stats}
        self._first_turn(rollouts, samples, seed, progress, common)
        live = [r for group in rollouts for r in group if self._parse(r, r.completion_ids, r.prompt_ids)]
        for turn in range(1, self.max_turns + 1):
            live = self._answer(live, max_new_tokens)
            if not live:
                break
            continuations = self.inner.sample_ids(
                [r.prompt_ids + r.completion_ids for r in live],
                **common,
                n=1,
                seed=seed + ROUND_SEED_STRIDE * turn,
            )
            still = []
            for rollout, (more,) in zip(live, continuations, strict=True):
                room = max_new_tokens - len(rollout.completion_ids)
                more = more[: max(room, 0)]
                prefix = rollout.prompt_ids + rollout.completion_ids
                rollout.completion_ids += more
                if more and self._parse(rollout, more, prefix):
                    still.append(rollout)
            live = still
        return [[self._finished(r) for r in group] for group in rollouts]

    def _start(self, prompt: ToolPrompt) -> _Rollout:
        """A rollout's environment (reset with its row, as TRL resets it) and its rendered prompt."""
        environment = self.toolbox.factory()
        messages = copy.deepcopy(prompt.messages)
        observation = environment.reset(**prompt.row)
        if isinstance(observation, str) and observation:  # TRL adds a reset's text to the last message
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        tools = tool_methods(environment)
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return _Rollout(list(ids), environment, tools)

    def _first_turn(
        self,
        rollouts: list[list[_Rollout]],
        samples: int,
        seed: int,
        progress: Callable[[int, int], None] | None,
        common: dict[str, Any],
    ) -> None:
        """Every prompt's first turn, ``samples`` at once where a prompt's rollouts start alike (the usual case),
        one at a time for a prompt whose environments answered their reset differently."""
        alike = [group for group in rollouts if all(r.prompt_ids == group[0].prompt_ids for r in group)]
        apart = [r for group in rollouts if group not in alike for r in group]
        if alike:
            drawn = self.inner.sample_ids(
                [group[0].prompt_ids for group in alike],
                **common,
                n=samples,
                seed=seed,
                progress=progress if not apart else None,
            )
            for group, completions in zip(alike, drawn, strict=True):
                for rollout, ids in zip(group, completions, strict=True):
                    rollout.completion_ids = list(ids)
        if apart:
            drawn = self.inner.sample_ids([r.prompt_ids for r in apart], **common, n=1, seed=seed, progress=progress)
            for rollout, (ids,) in zip(apart, drawn, strict=True):
                rollout.completion_ids = list(ids)

    def _parse(self, rollout: _Rollout, ids: list[int], prefix: list[int]) -> bool:
        """Add the turn ``ids`` (after ``prefix``) to the rollout's messages; True when it calls a tool."""
        from trl.chat_template_utils import parse_response

        if not ids:
            return False
        message = parse_response(self.tokenizer, ids, prefix=prefix, tools=rollout.tools)
        rollout.messages.append(message)
        return bool(message.get("tool_calls"))

    def _answer(self, live: list[_Rollout], budget: int) -> list[_Rollout]:
        """Run each live rollout's calls and append their answers (messages and ids); the rollouts that fit a next
        turn. A round whose answers would pass ``budget`` or the context length is taken back (TRL drops it too)."""
        fitting = []
        for rollout, answers in zip(live, self._answers_of(live), strict=True):
            suffix = suffix_ids_of(self.tokenizer, answers)
            total = len(rollout.completion_ids) + len(suffix)
            if total > budget or len(rollout.prompt_ids) + total >= self.context:
                continue
            rollout.messages.extend(answers)
            rollout.completion_ids += suffix
            fitting.append(rollout)
        return fitting

    def _answers_of(self, live: list[_Rollout]) -> list[list[dict[str, Any]]]:
        """Each live rollout's answers to its last message's calls: a rollout's calls in order, the rollouts' at
        once (up to ``tools.concurrent_calls``), so a batch waits for its slowest rollout, not for the sum."""

        def answers(rollout: _Rollout) -> list[dict[str, Any]]:
            return [self._call(rollout, call) for call in rollout.messages[-1]["tool_calls"]]

        if self.concurrent_calls <= 1 or len(live) <= 1:
            return [answers(rollout) for rollout in live]
        with ThreadPoolExecutor(min(self.concurrent_calls, len(live)), thread_name_prefix="grpoflow-calls") as pool:
            return list(pool.map(answers, live))

    @staticmethod
    def _call(rollout: _Rollout, call: dict[str, Any]) -> dict[str, Any]:
        """One tool call's answer as a tool message (TRL's error form for a call that raised or names no tool)."""
        function = call.get("function", {}) if call.get("type") == "function" else {}
        name = function.get("name") or call.get("name", "unknown")
        tools = {tool.__name__: tool for tool in rollout.tools}
        try:
            if call.get("type") != "function":
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            content = str(tools[name](**function.get("arguments", {})))
        except Exception as error:  # noqa: BLE001 - the model reads the error, the rollout goes on
            content = error_answer(error)
        return {"role": "tool", "name": name, "content": content}

    @staticmethod
    def _finished(rollout: _Rollout) -> Conversation:
        return Conversation(rollout.messages, record_json(rollout.environment.tool_calls))


def tool_sampler(inner: Any, config: Any, context: int) -> ToolSampler:
    """The pipeline's tools around an engine sampler whose tokenizer is not yet ready for them (prepared here)."""
    from tasks.environments import pipeline_tools

    toolbox, template = pipeline_tools(config, inner.tokenizer)
    return ToolSampler(inner, toolbox, template, config.tools.max_turns, context)
