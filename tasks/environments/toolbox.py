"""The tools of a pipeline as one environment class (TRL's ``environment_factory``): one instance per rollout, its
public methods the tools the model sees, ``reset`` at the start of each rollout. Plain ``tools=`` would be the same
functions for every rollout, so the per-rollout limits (``tools.max_calls``, ``max_seconds``, ``max_output_bytes``)
and the python tool's session need an instance each.

Every call is recorded on the instance (``tool_calls``: name, arguments, the answer the model read, its time,
whether it failed) for the rollout ledger. A call that fails, runs past its time or passes a limit raises: TRL (and
grpoflow's own loop, the same way) answers the model ``{'error': ...}`` and counts a failure; the rollout goes on.
TRL applies no timeout and runs sync tools one after another, so each tool bounds its own time: python through the
sandbox, a user's tool in a thread abandoned at ``tools.call_timeout_s``.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tasks.config import PYTHON_TOOL, ToolSettings, ToolSpec, import_object
from tasks.environments.python_tool import PythonLimits, run_python
from tasks.errors import UserError

# Names TRL gives a meaning of their own on an environment (or never lists as tools).
RESERVED = ("reset", "get_reward")


class ToolLimitReached(RuntimeError):
    """A call past one of the rollout's limits (calls, time, bytes of answers): the model is told, nothing runs."""


class ToolTimeout(RuntimeError):
    """A user's tool ran past ``tools.call_timeout_s``."""


class ToolError(UserError, ValueError):
    """A configured tool that cannot be a tool (import, schema, names); the message names its ``tools.use`` entry."""


@dataclass
class ToolRecord:
    """One call of a rollout: what the model asked, what it read back, how long it took, whether it failed."""

    name: str
    arguments: dict[str, Any]
    answer: str
    seconds: float
    failed: bool
    kind: str = "ok"  # ok | error (the program or tool failed) | limit | timeout


def error_answer(error: BaseException) -> str:
    """What the model reads for a call that raised: TRL's ``str({"error": str(e)})``, the same in grpoflow's loop.

    >>> error_answer(ToolLimitReached("no more calls"))
    "{'error': 'no more calls'}"
    """
    return str({"error": str(error)})


class RolloutTools:
    """The base of the environment class: limits and records. Only the tools are public (TRL lists every public
    function of the class as a tool); the subclass ``environment_class`` builds adds them."""

    _settings: ToolSettings
    _python: PythonLimits | None = None
    _environment: Any = None
    _make_environment: Callable[[], Any] | None = None

    def __init__(self) -> None:
        self.tool_calls: list[ToolRecord] = []
        self._cells: list[str] = []
        self._seconds = 0.0
        self._bytes = 0
        if self._make_environment is not None:
            self._environment = self._make_environment()

    def reset(self, **row: Any) -> Any:
        """A new rollout: no calls, no time or bytes spent, a fresh python session; a user environment's own
        ``reset`` gets the row and its answer (text added to the prompt) is returned."""
        self.tool_calls, self._cells, self._seconds, self._bytes = [], [], 0.0, 0
        if self._environment is not None:
            return self._environment.reset(**row)
        return None

    def _refusal(self) -> str | None:
        settings = self._settings
        if len(self.tool_calls) >= settings.max_calls:
            return f"no more tool calls in this answer: {settings.max_calls} is the limit (tools.max_calls)"
        if self._seconds >= settings.max_seconds:
            return f"no tool time left in this answer: {settings.max_seconds:g} s is the limit (tools.max_seconds)"
        if self._bytes >= settings.max_output_bytes:
            return (
                f"no room left for tool answers in this answer: {settings.max_output_bytes} bytes is the limit "
                "(tools.max_output_bytes)"
            )
        return None

    def _call(self, name: str, arguments: dict[str, Any], run: Callable[[], tuple[str, bool, float | None]]) -> str:
        """Run one call within the rollout's limits and record it; raise (TRL answers the error) when it cannot.
        ``run`` gives the answer, whether it failed, and the seconds the call's own work took where it knows them
        (python: the sandbox run, not the wait for a worker other rollouts' calls hold); else the wall time counts."""
        refusal = self._refusal()
        if refusal is not None:
            error = ToolLimitReached(refusal)
            self.tool_calls.append(ToolRecord(name, arguments, error_answer(error), 0.0, True, "limit"))
            raise error
        started = time.perf_counter()
        try:
            text, failed, own = run()
        except Exception as error:
            seconds = time.perf_counter() - started
            self._seconds += seconds
            kind = "timeout" if isinstance(error, ToolTimeout) else "error"
            self.tool_calls.append(ToolRecord(name, arguments, error_answer(error), seconds, True, kind))
            raise
        seconds = time.perf_counter() - started if own is None else own
        self._seconds += seconds
        text = self._within_bytes(text)
        self.tool_calls.append(ToolRecord(name, arguments, text, seconds, failed, "error" if failed else "ok"))
        return text

    def _within_bytes(self, text: str) -> str:
        """``text`` cut to the rollout's room for tool answers (``tools.max_output_bytes``), saying so."""
        left = self._settings.max_output_bytes - self._bytes
        data = text.encode()
        if len(data) > left:
            text = (
                data[: max(left, 0)].decode("utf-8", "ignore") + f"\n[cut: tool answers hold at most {left} more bytes]"
            )
        self._bytes += min(len(data), max(left, 0))
        return text

    def _run_python(self, code: str) -> tuple[str, bool, float | None]:
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        answer = run_python(code, self._python, self._cells if self._settings.session else ())
        if answer.status == "passed":  # a cell that failed, ran out of time or memory is not replayed: it would again
            self._cells.append(code)
        return answer.text, answer.failed, answer.seconds


def python(self, code: str) -> str:  # noqa: ANN001 - no hint on self: the schema skips it
    """Run Python code (no network, no files) and return what it prints, and the value of a last expression.

    Args:
        code: The program.
    """
    return self._call(PYTHON_TOOL, {"code": code}, lambda: self._run_python(code))


class ToolThreadsExhausted(RuntimeError):
    """Every user-tool thread of this process is taken, by calls running or still running past their time limit."""


_thread_slots: dict[int, threading.BoundedSemaphore] = {}
_thread_slots_lock = threading.Lock()


def tool_thread_slots(count: int) -> threading.BoundedSemaphore:
    """The process's slots for user-tool threads, ``count`` of them (one semaphore per count, shared by every
    rollout): a thread holds its slot until its tool returns, also after the caller gave up on it."""
    with _thread_slots_lock:
        return _thread_slots.setdefault(count, threading.BoundedSemaphore(count))


def bounded(
    function: Callable[..., Any],
    arguments: dict[str, Any],
    timeout_s: float,
    slots: threading.BoundedSemaphore | None = None,
) -> Any:
    """``function(**arguments)`` (awaited when it is async) in a daemon thread, abandoned at ``timeout_s``: a thread
    cannot be killed, and a hung tool must hold up neither the rollout nor the process's exit. With ``slots``, the
    thread takes one until the tool returns, and a call finding none free is refused: hung tools cannot pile up
    threads without end.

    >>> bounded(lambda a, b: a + b, {"a": 2, "b": 3}, 1.0)
    5
    """
    outcome: dict[str, Any] = {}
    if slots is not None and not slots.acquire(blocking=False):
        raise ToolThreadsExhausted(
            "too many user-tool calls are still running (earlier ones past their time limit, "
            "tools.call_timeout_s); no new call until one ends"
        )

    def call() -> None:
        try:
            value = function(**arguments)
            outcome["value"] = asyncio.run(value) if inspect.isawaitable(value) else value
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error
        finally:
            if slots is not None:
                slots.release()

    worker = threading.Thread(target=call, name="grpoflow-tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ToolTimeout(f"the tool ran past its time limit ({timeout_s:g} s, tools.call_timeout_s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def as_method(name: str, target: Callable[[RolloutTools], Callable[..., Any]], original: Callable[..., Any]) -> Any:
    """A tool method that calls ``target(instance)(**arguments)`` within the rollout's limits, carrying the name,
    signature (``self`` first), resolved type hints and docstring of ``original``: what TRL builds the schema from."""

    def method(self: RolloutTools, **arguments: Any) -> str:
        settings = self._settings
        slots = tool_thread_slots(2 * settings.concurrent_calls)
        timeout = settings.call_timeout_s
        return self._call(name, arguments, lambda: (str(bounded(target(self), arguments, timeout, slots)), False, None))

    signature = inspect.signature(original)
    receiver = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[receiver, *signature.parameters.values()])  # type: ignore[attr-defined]
    try:  # resolved here, where the original's module is known: the method's own globals are this module's
        method.__annotations__ = typing.get_type_hints(original)
    except Exception:  # noqa: BLE001 - unresolvable hints: the schema check names the tool
        method.__annotations__ = dict(getattr(original, "__annotations__", {}))
    method.__name__ = method.__qualname__ = name
    method.__doc__ = original.__doc__
    return method


def environment_class(settings: ToolSettings) -> type[RolloutTools]:
    """The environment class of ``settings.use``: the python tool, each function tool, and the public methods of
    at most one environment class, as methods of one ``RolloutTools`` subclass. ToolError names the entry that
    cannot be a tool (not importable, a name twice or reserved, an environment that owns its reward)."""
    namespace: dict[str, Any] = {"_settings": settings}
    for index, spec in enumerate(settings.use):
        where = f"tools.use.{index} ({spec.name})"
        if spec.name == PYTHON_TOOL:
            namespace["_python"] = PythonLimits(**spec.python_args())
            _add(namespace, PYTHON_TOOL, python, where)
            continue
        try:
            found = import_object(spec.name, spec.path)
        except ValueError as exc:
            raise ToolError(f"{where}: {exc}") from exc
        if inspect.isclass(found):
            _add_environment(namespace, found, spec, where)
        elif callable(found):
            if spec.args:
                raise ToolError(f"{where}: a function tool takes no args (bind them in its module)")
            _add(namespace, spec.label, as_method(spec.label, lambda _self, f=found: f, found), where)
        else:
            raise ToolError(f"{where}: not a function or a class")
    return type("GrpoflowTools", (RolloutTools,), namespace)


def _add(namespace: dict[str, Any], name: str, method: Any, where: str) -> None:
    if name in RESERVED or name.startswith("_"):
        raise ToolError(f"{where}: {name!r} cannot name a tool (reserved, or private)")
    if name in namespace:
        raise ToolError(f"{where}: a second tool named {name!r}")
    namespace[name] = method


def _add_environment(namespace: dict[str, Any], cls: type, spec: ToolSpec, where: str) -> None:
    """An environment class's public methods as tools of the instance it makes per rollout (``spec.args``)."""
    if "_make_environment" in namespace:
        raise ToolError(f"{where}: a second environment class (one per pipeline)")
    if not callable(getattr(cls, "reset", None)):
        raise ToolError(f"{where}: an environment class needs a reset(**row) method (TRL calls it per rollout)")
    if callable(getattr(cls, "get_reward", None)):
        raise ToolError(
            f"{where}: an environment that owns its reward (get_reward) is not supported: grpoflow's rewards score "
            "the completion in every stage (probe, GRPO, evaluation); write the check as a reward function"
        )
    namespace["_make_environment"] = staticmethod(lambda: cls(**spec.args))
    for name, function in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name in RESERVED or name.startswith("_"):
            continue
        bound = as_method(name, lambda self, n=name: getattr(self._environment, n), _unbound_view(function))
        _add(namespace, name, bound, where)


def _unbound_view(function: Callable[..., Any]) -> Callable[..., Any]:
    """A view of an environment method without its ``self``: the signature and hints the model's calls see."""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())[1:]

    def view(*args: Any, **kwargs: Any) -> Any:  # never called: only read for its signature
        raise NotImplementedError

    view.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001
        hints = dict(getattr(function, "__annotations__", {}))
    view.__annotations__ = {k: v for k, v in hints.items() if k != "self"}
    view.__doc__, view.__name__ = function.__doc__, function.__name__
    return view


def tool_methods(environment: RolloutTools) -> list[Callable[..., Any]]:
    """An instance's tools as TRL lists them (its class's public functions, by name): the order of the schemas in
    the prompt, the same in GRPO and in grpoflow's own loop."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


class Toolbox:
    """A pipeline's tools: the environment class, each tool's schema (checked: a tool TRL cannot describe is one
    error naming it), and what the model card and the caches say about them."""

    def __init__(self, settings: ToolSettings) -> None:
        self.settings = settings
        self.environment_class = environment_class(settings)
        self.schemas = tool_schemas(tool_methods(self.factory()), settings)

    def factory(self) -> RolloutTools:
        """A fresh environment: what TRL's ``environment_factory`` and grpoflow's loop call once per rollout."""
        return self.environment_class()

    @property
    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]

    def describe(self) -> dict[str, Any]:
        """The tools and their limits, for the model card, the run's tags and the evaluation table."""
        settings = self.settings
        tools = []
        for spec in settings.use:
            entry: dict[str, Any] = {"name": spec.label, "source": spec.name}
            if spec.name == PYTHON_TOOL:
                entry["limits"] = spec.python_args()
            elif spec.args:
                entry["args"] = spec.args
            tools.append(entry)
        limits = {k: getattr(settings, k) for k in ("max_turns", "max_calls", "max_seconds", "max_output_bytes")}
        limits |= {"call_timeout_s": settings.call_timeout_s, "session": settings.session}
        return {"tools": tools, "methods": self.names, "per_rollout": limits}

    def digest(self) -> str:
        """A key of what the model is shown and what the tools do: schemas, sources, limits (the evaluation cache's
        key holds it, so a changed tool samples again)."""
        payload = json.dumps({"schemas": self.schemas, **self.describe()}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tool_schemas(methods: list[Callable[..., Any]], settings: ToolSettings) -> list[dict[str, Any]]:
    """Each tool's JSON schema as TRL builds it (transformers' ``get_json_schema``: type hints and a Google-style
    docstring with an ``Args:`` line per argument); ToolError names the tool that has neither."""
    from transformers.utils import get_json_schema

    schemas = []
    for method in methods:
        try:
            schemas.append(get_json_schema(method))
        except Exception as exc:  # DocstringParsingException, TypeHintParsingException
            source = next((s.name for s in settings.use if s.label == method.__name__), method.__name__)
            raise ToolError(
                f"tool {method.__name__} ({source}) cannot be described to the model: {exc}; a tool needs type hints "
                "on every argument and a docstring with an 'Args:' line for each (TRL builds its schema from them)"
            ) from exc
    return schemas


def record_json(records: list[ToolRecord]) -> list[dict[str, Any]]:
    """Records as plain data (the ledger's turns, the probe's samples)."""
    return [asdict(record) for record in records]


def pipeline_tools(config: Any, tokenizer: Any) -> tuple[Toolbox, Any] | None:
    """A pipeline's tools and the template they render with (``tokenizer`` prepared in place), or None without
    tools: what SFT, GRPO and the samplers of probe and evaluation each set up the same way."""
    if not config.tools.enabled:
        return None
    from tasks.environments.chat_template import prepare_tokenizer

    template = prepare_tokenizer(tokenizer, config.tools.chat_template, config.model.source)
    return Toolbox(config.tools), template
