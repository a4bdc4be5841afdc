"""Helpers shared by reward functions: completion text, boxed-answer extraction, the question a prompt asks.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

Completion = str | list[dict[str, Any]]
# A boxed answer longer than this is answer-stuffing, not an answer (nor worth a parse that can take seconds).
MAX_ANSWER_CHARS = 1000


def completion_text(completion: Completion) -> str:
    """The text of one completion, plain or chat (a list of messages: the last assistant message's content counts,
    so a tool-using conversation is judged on its final answer, not on a tool's output or an earlier turn).

    >>> completion_text("The answer is 4")
    'The answer is 4'
    >>> completion_text([{"role": "assistant", "content": "\\\\boxed{4}"}])
    '\\\\boxed{4}'
    >>> completion_text([{"role": "assistant", "content": "\\\\boxed{5}"}, {"role": "tool", "content": "\\\\boxed{4}"}])
    '\\\\boxed{5}'
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, list):
        return ""
    messages = [m for m in completion if isinstance(m, dict)]
    answers = [m for m in messages if m.get("role", "assistant") == "assistant"] or messages[-1:]
    if not answers:
        return ""
    content = answers[-1].get("content", "")
    return content if isinstance(content, str) else str(content)


def boxed_contents(text: str) -> list[str]:
    """Every ``\\boxed{...}`` content in order, with nested braces balanced; unclosed ones are skipped.

    >>> boxed_contents(r"so \\boxed{\\frac{1}{2}} or \\boxed{3}")
    ['\\\\frac{1}{2}', '3']
    >>> boxed_contents(r"\\boxed{12")
    []
    """
    found: list[str] = []
    start = 0
    marker = "\\boxed{"
    while (index := text.find(marker, start)) != -1:
        depth, cursor = 1, index + len(marker)
        while cursor < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[cursor], 0)
            cursor += 1
        if depth == 0:
            found.append(text[index + len(marker) : cursor - 1])
        start = index + len(marker)
    return found


def last_boxed(text: str) -> str | None:
    """The final ``\\boxed{}`` content, the one that counts as the answer.

    >>> last_boxed(r"first \\boxed{1}, final \\boxed{2}")
    '2'
    >>> last_boxed("no box") is None
    True
    """
    contents = boxed_contents(text)
    return contents[-1].strip() if contents else None


_TURNS = (  # (where a user turn starts, where it ends) in the chat templates grpoflow meets
    ("<|im_start|>user\n", "<|im_end|>"),  # ChatML (SmolLM2, Qwen)
    ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),  # Llama 3
    ("[INST]", "[/INST]"),  # Mistral, Llama 2
)


def question_of(prompt: Any) -> str:
    """What the user asked in a prompt (a ledger row's, or the rendered prompt TRL hands a reward): the last user
    turn of a rendered chat (or of a message list), else the prompt itself; the chat template's wrapping, the same
    on every row, is left out.

    >>> question_of("<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n"
    ...             "<|im_start|>assistant\\n")
    'What is 2+3?'
    >>> question_of([{"role": "user", "content": "Name a prime."}]), question_of("plain text")
    ('Name a prime.', 'plain text')
    >>> question_of('[{"role": "user", "content": "Name a prime."}]')  # a message list as the ledger keeps it
    'Name a prime.'
    """
    if isinstance(prompt, str) and prompt.startswith("[{"):
        with contextlib.suppress(ValueError):
            prompt = json.loads(prompt)
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]).strip() if users else str(prompt)
    text = str(prompt)
    for start, end in _TURNS:
        if start in text:
            return text.rsplit(start, 1)[1].split(end, 1)[0].strip()
    return text.strip()


_CHAT_TURNS = (  # a whole turn, its role captured, in the chat templates grpoflow meets
    re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S),  # ChatML (SmolLM2, Qwen)
    re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S),  # Llama 3
)


def conversation_of(prompt: Any) -> list[dict[str, str]]:
    """The turns of a prompt as messages: a message list as it is (its JSON text as the ledger keeps it too), the
    complete turns of a rendered chat, else the prompt as one user turn.

    >>> conversation_of("<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n"
    ...                 "<|im_start|>assistant\\n")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+3?'}]
    >>> conversation_of("Name a prime.")
    [{'role': 'user', 'content': 'Name a prime.'}]
    """
    if isinstance(prompt, str) and prompt.startswith("[{"):
        with contextlib.suppress(ValueError):
            prompt = json.loads(prompt)
    if isinstance(prompt, list):
        return [
            {"role": str(m.get("role", "user")), "content": str(m.get("content") or "").strip()}
            for m in prompt
            if isinstance(m, dict)
        ]
    text = str(prompt)
    for pattern in _CHAT_TURNS:
        turns = pattern.findall(text)
        if turns:
            return [{"role": role, "content": content.strip()} for role, content in turns]
    return [{"role": "user", "content": question_of(text)}]


def prompt_text(prompt: Any) -> str:
    """The whole prompt a judge reads and keys its verdicts by: a single user turn is its own text; a conversation
    (a system prompt, earlier turns) is every turn, each after its role, so two prompts that differ anywhere never
    share a verdict.

    >>> prompt_text([{"role": "user", "content": "Name a prime."}])
    'Name a prime.'
    >>> prompt_text([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a prime."}])
    'System: Answer in French.\\n\\nUser: Name a prime.'
    """
    turns = conversation_of(prompt)
    if len(turns) == 1 and turns[0]["role"] == "user":
        return turns[0]["content"]
    return "\n\n".join(f"{turn['role'].capitalize()}: {turn['content']}" for turn in turns)
