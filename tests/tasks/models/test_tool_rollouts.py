"""grpoflow's own tool loop (probe, evaluation, the in-training hold-out) on the tiny model that calls the python
tool: rollouts hold real calls answered by the sandbox, each recorded, and the same seed gives the same
conversations."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.models import Conversation, policy_sampler, resolve_model_source

REPO = Path(__file__).resolve().parents[3]


def _without_times(conversation: Conversation) -> tuple:
    return list(conversation), [{k: v for k, v in call.items() if k != "seconds"} for call in conversation.calls]


@pytest.fixture(scope="module")
def sampler():
    config = load_config(REPO / "configs" / "tiny-tools.yaml")
    return config, policy_sampler(config, resolve_model_source(config.model.source), None, batch_size=4)


def test_rollouts_call_the_sandbox_and_the_same_seed_gives_the_same_conversations(sampler) -> None:  # noqa: ANN001
    from tasks.inputs import arithmetic_rows

    config, tools = sampler
    rows = arithmetic_rows(config.data.arithmetic, config.seed)[:3]
    prompts = [tools.prompt_of(row, config.data.system_prompt) for row in rows]
    first = tools.sample(prompts, n=2, temperature=0.7, max_new_tokens=160, seed=3)
    again = tools.sample(prompts, n=2, temperature=0.7, max_new_tokens=160, seed=3)
    assert [[_without_times(c) for c in group] for group in first] == [
        [_without_times(c) for c in group] for group in again
    ]
    conversations = [c for group in first for c in group]
    assert all(isinstance(c, Conversation) and c[0]["role"] == "assistant" for c in conversations)
    called = [c for c in conversations if any(m["role"] == "tool" for m in c)]
    assert called, "the tiny tool caller made no call"
    for conversation in called:
        for call_turn, answer in zip(conversation, conversation[1:], strict=False):
            if answer["role"] != "tool":
                continue
            code = call_turn["tool_calls"][0]["function"]["arguments"]["code"]
            environment = tools.toolbox.factory()
            assert answer["content"] == environment.python(code)  # what the sandbox answers that code
        assert len(conversation.calls) == sum(m["role"] == "tool" for m in conversation)


def test_greedy_without_tools_is_the_engine_alone_on_the_same_template(sampler) -> None:  # noqa: ANN001
    config, tools = sampler
    plain = tools.without_tools
    assert plain.backend == tools.backend == "transformers" and plain.tokenizer is tools.tokenizer
    assert tools.identity()["template"] and tools.identity()["tools"] == tools.toolbox.digest()
