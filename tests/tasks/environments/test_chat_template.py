"""grpoflow's tool template against TRL's own checks and TRL's own code: it takes tool calls, is prefix-preserving,
parses back what it renders, and the tokens after a tool call are the ones TRL's trainer computes (what its
tool_mask masks out of the loss)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from trl import GRPOTrainer
from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from tasks.config import ToolSettings
from tasks.environments import ChatTemplateError, Toolbox, prepare_tokenizer, tool_methods, tool_suffix_ids
from tasks.models import TINY_RANDOM_TOOLS, load_tokenizer, resolve_model_source

CALL = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6 * 7)"}}}
CONVERSATION = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "python", "content": "42"},
    {"role": "assistant", "content": "\\boxed{42}"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = load_tokenizer(resolve_model_source(TINY_RANDOM_TOOLS))
    template = prepare_tokenizer(tokenizer, "grpoflow", "the tiny model")
    assert template.source == "grpoflow" and template.family == "tiny"
    return tokenizer


def test_trl_accepts_the_template(tokenizer) -> None:  # noqa: ANN001
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)


def test_a_rendered_tool_call_parses_back_to_the_same_call(tokenizer) -> None:  # noqa: ANN001
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    parsed = tokenizer.parse_response(text.removeprefix(prompt), prefix=prompt)
    assert parsed["tool_calls"] == [CALL]


def test_arguments_as_json_text_render_as_the_same_bytes_as_an_object(tokenizer) -> None:  # noqa: ANN001
    as_text = json.loads(json.dumps(CONVERSATION))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(CALL["function"]["arguments"])
    assert tokenizer.apply_chat_template(as_text, tokenize=False) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_the_tokens_after_a_call_are_trls_own(tokenizer) -> None:  # noqa: ANN001
    trainer = SimpleNamespace(processing_class=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False)
    trainer._tokenizer = tokenizer
    for answers in (
        [{"role": "tool", "name": "python", "content": "42"}],
        [
            {"role": "tool", "name": "python", "content": "Error: x\n1"},
            {"role": "tool", "name": "python", "content": ""},
        ],
    ):
        assert tool_suffix_ids(tokenizer, answers) == GRPOTrainer._get_tool_suffix_ids(trainer, answers)


def test_the_assistant_mask_covers_the_models_turns_and_never_a_tool_answer(tokenizer) -> None:  # noqa: ANN001
    tools = tool_methods(Toolbox(ToolSettings(use=[{"name": "python"}])).factory())
    out = tokenizer.apply_chat_template(
        CONVERSATION, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
    assert trained == (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call></s>\\boxed{42}</s>'
    )


def test_a_template_that_cannot_take_tools_is_one_error_saying_what_to_do() -> None:
    plain = load_tokenizer(resolve_model_source(TINY_RANDOM_TOOLS))
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="use a model with a tool-calling template"):
        prepare_tokenizer(plain, "auto", "my-model")
    with pytest.raises(ChatTemplateError, match="tools.chat_template is 'model'"):
        prepare_tokenizer(plain, "model", "my-model")


def test_a_model_template_without_generation_markers_is_replaced_or_refused_before_sft() -> None:
    """SFT's assistant-only loss needs ``{% generation %}`` markers: a model template that takes tool calls but has
    none is replaced by grpoflow's where its turns are known (auto), and refused by name with ``model``."""
    from tasks.environments.chat_template import TINY, grpoflow_template, response_template

    unmarked = load_tokenizer(resolve_model_source(TINY_RANDOM_TOOLS))
    template = grpoflow_template(TINY)
    unmarked.chat_template = re.sub(r"\{%-? ?(end)?generation -?%\}", "", template)
    assert "generation %}" not in unmarked.chat_template and "generation %}" in template
    unmarked.response_template = response_template(TINY)
    with pytest.raises(ChatTemplateError, match="marks no {% generation %} turns"):
        prepare_tokenizer(unmarked, "model", "my-model")
    chosen = prepare_tokenizer(unmarked, "auto", "my-model")
    assert chosen.source == "grpoflow" and "generation %}" in unmarked.chat_template
