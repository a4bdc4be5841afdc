"""Tool traces a program writes, for SFT to teach the tool-call format: the assistant calls the python tool with
code that computes the answer, reads the tool's real answer (the call runs in the sandbox, through the rollout's
environment, so the trace holds exactly what the tool returns), then gives the final answer.

For the built-in arithmetic task the code is the question's expression (``print(123 * 456)``). Rows of other data
bring their own traces (a ``completion`` that is a list of messages) or are learned without a tool call.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tasks.config import PYTHON_TOOL
from tasks.environments.toolbox import Toolbox, error_answer

_ARITHMETIC = re.compile(r"What is ([0-9+\-* ]+)\?")


def arithmetic_code(question: str) -> str | None:
    """The program that answers a built-in arithmetic question, or None for another question.

    >>> arithmetic_code("What is 123 * 456? Put the final answer in \\\\boxed{}."), arithmetic_code("Hi")
    ('print(123 * 456)', None)
    """
    found = _ARITHMETIC.match(question.strip())
    return f"print({found.group(1).strip()})" if found else None


def last_user_text(prompt: Any) -> str:
    """The last user message of a prompt (a plain string is its own text).

    >>> last_user_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    'q'
    """
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def tool_call_message(name: str, arguments: dict[str, Any], content: str = "") -> dict[str, Any]:
    """An assistant turn that calls one tool, in the form chat templates render.

    >>> tool_call_message("python", {"code": "print(1)"})["tool_calls"][0]["function"]["name"]
    'python'
    """
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def python_trace(toolbox: Toolbox, code: str, final_answer: str) -> list[dict[str, Any]]:
    """The completion of one trace: the call, the tool's real answer (run now, in a fresh rollout), the answer."""
    environment = toolbox.factory()
    environment.reset()
    try:
        answer = environment.python(code)
    except Exception as error:  # noqa: BLE001 - a trace shows what the model would read
        answer = error_answer(error)
    return [
        tool_call_message(PYTHON_TOOL, {"code": code}),
        {"role": "tool", "name": PYTHON_TOOL, "content": answer},
        {"role": "assistant", "content": final_answer},
    ]


def arithmetic_traces(
    toolbox: Toolbox, prompts: Sequence[Any], final_answers: Sequence[str], workers: int = 4
) -> list[list[dict[str, Any]] | None]:
    """A python trace for each built-in arithmetic prompt (None where the prompt is not one, or no python tool is
    configured); the calls run a few at a time in the sandbox."""
    if PYTHON_TOOL not in toolbox.names:
        return [None] * len(prompts)
    codes = [arithmetic_code(last_user_text(prompt)) for prompt in prompts]

    def trace(index: int) -> list[dict[str, Any]] | None:
        code = codes[index]
        return None if code is None else python_trace(toolbox, code, final_answers[index])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(trace, range(len(prompts))))
