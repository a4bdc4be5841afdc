"""A pipeline's tools as the model sees and calls them: user functions and environment classes keep the name,
signature and docstring TRL builds their schema from; a tool TRL cannot describe is one error naming it; each
rollout's limits (calls, time, bytes of answers, a tool's own timeout) answer with an error, record it and let the
rollout go on.
"""

from __future__ import annotations

import inspect
import textwrap
import time
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from tasks.config import ToolSettings, import_object
from tasks.environments import Toolbox, ToolError, ToolLimitReached, error_answer
from tasks.environments.toolbox import ToolTimeout

USER_TOOLS = '''
import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


def unhinted(a):
    """Echo.

    Args:
        a: Anything.
    """
    return a


def sleeper(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


RUNNING = {"now": 0, "most": 0}


def overlap(seconds: float) -> str:
    """Sleep a while, counting the calls that sleep at the same time.

    Args:
        seconds: How long.
    """
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    time.sleep(seconds)
    RUNNING["now"] -= 1
    return "done"


def crash(reason: str) -> str:
    """Fail.

    Args:
        reason: Why.
    """
    raise RuntimeError("boom: " + reason)


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: What to say.
    """
    return text


async def later(word: str) -> str:
    """Answer after a pause.

    Args:
        word: What to answer.
    """
    await asyncio.sleep(0.01)
    return word.upper()


def reset(x: int) -> int:
    """A name TRL keeps for itself.

    Args:
        x: Anything.
    """
    return x


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.count = start

    def reset(self, **row):
        self.count = self.start
        return None

    def bump(self, by: int) -> int:
        """Raise the counter.

        Args:
            by: How much.
        """
        self.count += by
        return self.count


class Other:
    def reset(self, **row):
        return None

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


class Scored(Counter):
    def get_reward(self) -> float:
        return 1.0
'''


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("user-tools")
    (folder / "user_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    return folder


def box(folder: Path, *names: str, **settings) -> Toolbox:  # noqa: ANN003
    use = [{"name": f"user_tools:{name}", "path": str(folder)} for name in names]
    return Toolbox(ToolSettings(use=use, **settings))


def test_a_function_tool_keeps_its_name_signature_docstring_and_schema(tools_dir: Path) -> None:
    toolbox = box(tools_dir, "add", "later")
    original = import_object("user_tools:add", tools_dir)
    method = toolbox.environment_class.add
    assert toolbox.names == ["add", "later"]
    assert method.__name__ == "add" and method.__doc__ == original.__doc__
    assert list(inspect.signature(method).parameters) == ["self", "a", "b"]
    assert toolbox.schemas[0] == get_json_schema(original)
    environment = toolbox.factory()
    assert environment.add(a=2, b=3) == "5" and environment.later(word="ok") == "OK"  # an async tool is awaited
    assert [(r.name, r.arguments, r.answer, r.failed) for r in environment.tool_calls] == [
        ("add", {"a": 2, "b": 3}, "5", False),
        ("later", {"word": "ok"}, "OK", False),
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("undocumented", r"tool undocumented \(user_tools:undocumented\) cannot be described .* docstring"),
        ("unhinted", r"tool unhinted \(user_tools:unhinted\) cannot be described .* type hints"),
        ("reset", r"tools\.use\.0 \(user_tools:reset\): 'reset' cannot name a tool"),
        ("missing", r"tools\.use\.0 \(user_tools:missing\)"),
        ("Scored", r"get_reward\) is not supported"),
    ],
)
def test_a_tool_that_cannot_be_one_is_one_error_naming_it(tools_dir: Path, name: str, expected: str) -> None:
    with pytest.raises(ToolError, match=expected):
        box(tools_dir, name)


def test_an_environment_class_gives_each_rollout_its_own_state(tools_dir: Path) -> None:
    settings = ToolSettings(use=[{"name": "user_tools:Counter", "path": str(tools_dir), "args": {"start": 10}}])
    toolbox = Toolbox(settings)
    assert toolbox.names == ["bump"]
    assert list(inspect.signature(toolbox.environment_class.bump).parameters) == ["self", "by"]
    first, second = toolbox.factory(), toolbox.factory()
    first.reset(prompt="p")
    second.reset(prompt="q")
    assert first.bump(by=2) == "12" and first.bump(by=2) == "14" and second.bump(by=1) == "11"
    first.reset(prompt="p")
    assert first.tool_calls == [] and first.bump(by=1) == "11"
    with pytest.raises(ToolError, match="a second environment class"):
        Toolbox(ToolSettings(use=[*settings.use, {"name": "user_tools:Other", "path": str(tools_dir)}]))


def test_max_calls_refuses_the_next_call_and_records_it(tools_dir: Path) -> None:
    environment = box(tools_dir, "add", max_calls=2).factory()
    environment.add(a=1, b=1)
    environment.add(a=1, b=2)
    with pytest.raises(ToolLimitReached, match=r"2 is the limit \(tools\.max_calls\)") as refused:
        environment.add(a=1, b=3)
    assert environment.tool_calls[-1].kind == "limit" and environment.tool_calls[-1].answer == error_answer(
        refused.value
    )
    environment.reset()
    assert environment.add(a=2, b=2) == "4"  # a new rollout has its calls again


def test_a_tool_past_its_timeout_answers_an_error_at_once(tools_dir: Path) -> None:
    environment = box(tools_dir, "sleeper", call_timeout_s=0.3).factory()
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match=r"0\.3 s, tools\.call_timeout_s"):
        environment.sleeper(seconds=30)
    assert time.monotonic() - started < 2
    assert environment.tool_calls[-1].kind == "timeout" and environment.tool_calls[-1].failed


def test_tool_time_per_rollout_is_bounded(tools_dir: Path) -> None:
    environment = box(tools_dir, "sleeper", max_seconds=0.2).factory()
    assert environment.sleeper(seconds=0.25) == "woke"
    with pytest.raises(ToolLimitReached, match=r"tools\.max_seconds"):
        environment.sleeper(seconds=0.01)


def test_a_failing_tool_raises_for_the_trainer_to_answer_and_is_recorded(tools_dir: Path) -> None:
    environment = box(tools_dir, "crash", "add").factory()
    with pytest.raises(RuntimeError, match="boom: why") as failure:
        environment.crash(reason="why")
    assert environment.tool_calls[-1].answer == "{'error': 'boom: why'}" == error_answer(failure.value)
    assert environment.add(a=1, b=2) == "3"  # the rollout goes on


def test_answers_are_cut_at_the_rollouts_bytes_then_refused(tools_dir: Path) -> None:
    environment = box(tools_dir, "echo", max_output_bytes=100).factory()
    assert environment.echo(text="a" * 60) == "a" * 60
    cut = environment.echo(text="b" * 60)
    assert cut.startswith("b" * 40) and "b" * 41 not in cut and "[cut: tool answers hold at most 40 more bytes]" in cut
    with pytest.raises(ToolLimitReached, match=r"100 bytes is the limit \(tools\.max_output_bytes\)"):
        environment.echo(text="c")


def test_user_tool_threads_stay_bounded_while_hung_calls_run_past_their_timeout(tools_dir: Path) -> None:
    """A thread cannot be killed: a user tool past call_timeout_s is abandoned still running. At most twice
    tools.concurrent_calls such threads run in the process; a call past that answers an error at once, recorded,
    and calls work again once the hung ones have returned."""
    toolbox = box(tools_dir, "sleeper", call_timeout_s=0.05, concurrent_calls=1)  # two thread slots
    for _ in range(2):
        with pytest.raises(ToolTimeout):
            toolbox.factory().sleeper(seconds=1.0)
    refused = toolbox.factory()
    with pytest.raises(RuntimeError, match="too many user-tool calls are still running") as error:
        refused.sleeper(seconds=0.0)
    assert refused.tool_calls[-1].answer == error_answer(error.value) and refused.tool_calls[-1].failed
    time.sleep(1.2)
    assert toolbox.factory().sleeper(seconds=0.0) == "woke"


@pytest.mark.parametrize("concurrent_calls", [1, 4])
def test_the_tool_loop_runs_the_calls_of_a_batchs_rollouts_side_by_side(tools_dir: Path, concurrent_calls: int) -> None:
    """grpoflow's tool loop answers a round's calls rollout by rollout in order within a rollout, and up to
    tools.concurrent_calls rollouts at once: four rollouts each calling twice overlap with 4, never with 1."""
    from types import SimpleNamespace

    from tasks.environments import tool_methods
    from tasks.models.tool_rollouts import ToolSampler, _Rollout

    running = import_object("user_tools:overlap", tools_dir).__globals__["RUNNING"]
    running.update(now=0, most=0)
    toolbox = box(tools_dir, "overlap", concurrent_calls=concurrent_calls)
    sampler = ToolSampler(SimpleNamespace(tokenizer=None, backend="test"), toolbox, None, max_turns=2, context=1024)
    call = {"type": "function", "function": {"name": "overlap", "arguments": {"seconds": 0.2}}}
    rollouts = []
    for _ in range(4):
        environment = toolbox.factory()
        message = {"role": "assistant", "tool_calls": [call, call]}
        rollouts.append(_Rollout([1], environment, tool_methods(environment), messages=[message]))
    answers = sampler._answers_of(rollouts)
    assert [[a["content"] for a in rollout] for rollout in answers] == [["done", "done"]] * 4
    assert all(len(r.environment.tool_calls) == 2 for r in rollouts)
    assert running["most"] == (1 if concurrent_calls == 1 else 4)
