"""Pipeline stages: plain functions plus thin Prefect task wrappers (one module per stage here), and the packages
below them (``config``, ``inputs``, ``models``, ``training``, ``evaluation``, ``tracking``, ``registry``,
``speedups``), each importable from its package surface.

Importing the package sets the process's environment defaults, before Prefect, MLflow or transformers load:
this is the one place they are written (``flows.services`` hands the same ones to the servers it starts).
Must not import: a stage, or torch, Prefect, MLflow or transformers at import (the surfaces are lazy; of the
packages below, only ``tasks.speedups.allocator`` is loaded here, to set the allocator before any stack).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Any

# The network may be closed and users' data is theirs: no telemetry unless a user turns it back on.
TELEMETRY_OFF = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
RUNTIME_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    # Stage progress (generation batches, evaluation) goes to the Prefect UI's run logs too.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "tasks,reward_fns,flows",
    # MLflow's HTTP client retries for minutes when a server is gone; a run should fail in seconds and say so.
    # tracking.http_retries / tracking.http_timeout_s set these per run.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    # A console people can read: no artifact download bars, and no Prefect warning about log lines written
    # outside a flow run (a command such as `generate` runs none; the lines still reach the console).
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # ... nor transformers' "Loading weights" / "Writing model shards" bars (each model load drew one; the training
    # bar is tqdm's own and stays).
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # ... nor datasets' map bars ("Building labels", "Truncating train dataset", each SFT/GRPO start drew three).
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # vLLM's own console handler off: its records follow the console's rules and go to a log file
    # (tasks/models/vllm_logs.py, set up at the end of this module). A vLLM server process gets it back on.
    "VLLM_CONFIGURE_LOGGING": "0",
    # TRL warns at every GRPO start that environment_factory (how grpoflow hands it the tools) is experimental: it
    # is chosen knowingly (docs/tools.md), and the lock pins the TRL it was run on.
    "TRL_EXPERIMENTAL_SILENCE": "1",
}
for _name, _value in {**TELEMETRY_OFF, **RUNTIME_DEFAULTS}.items():
    os.environ.setdefault(_name, _value)

# glibc keeps the memory a run frees (this process, and the ones it starts): fewer page faults at every step.
from tasks.speedups.allocator import keep_freed_memory  # noqa: E402 - after the defaults above, before any stack

keep_freed_memory()

# Stage progress is INFO; Prefect's root logger is at WARNING, so grpoflow's own loggers say their level.
for _package in ("tasks", "reward_fns", "flows"):
    if logging.getLogger(_package).level == logging.NOTSET:
        logging.getLogger(_package).setLevel(logging.INFO)


def restore_defaults(instance: Any, state: dict[str, Any]) -> None:
    """A dataclass's ``__setstate__``: the pickled state, and the defaults of fields added since it was pickled
    (a field with a ``default_factory`` has no class attribute to fall back on), so Prefect's cached results of a
    run started before a release still load after it.

    >>> import dataclasses, pickle
    >>> @dataclasses.dataclass
    ... class Result:
    ...     name: str
    ...     added: list = dataclasses.field(default_factory=list)
    ...     __setstate__ = restore_defaults
    >>> restored = Result.__new__(Result); restored.__setstate__({"name": "old"}); restored
    Result(name='old', added=[])
    """
    import dataclasses

    instance.__dict__.update(state)
    for field in dataclasses.fields(instance):
        if field.name in instance.__dict__:
            continue
        if field.default is not dataclasses.MISSING:
            instance.__dict__[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            instance.__dict__[field.name] = field.default_factory()


def lazy_surface(package: str, exports: dict[str, str]) -> tuple[Any, Any, list[str]]:
    """A package's public surface, loaded on first use (as TRL's ``_LazyModule``): ``exports`` maps each public
    name to the module behind the package that defines it. Importing the package imports none of them, so a name
    costs only its own module's imports, and the files behind a package can move without breaking callers.

    >>> getattr_, dir_, all_ = lazy_surface("tasks.tracking", {"client_for": "client"})
    >>> getattr_("client_for").__module__, all_
    ('tasks.tracking.client', ['client_for'])
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__, sorted(exports)


# Compatibility, not rooms: module paths that persisted objects still name. A registered version's stored loader
# (``tasks/registry/pyfunc_adapter.py`` as it was when the version was registered) imports ``tasks.data``,
# ``tasks.sources``, ``tasks.generation`` and ``tasks.packaging``; Prefect's pickled stage results name
# ``tasks.forgetting.GeneralAbility``. (``tasks.models``, ``tasks.training``, ``tasks.config`` and
# ``tasks.registry`` are packages now whose surfaces keep the old modules' names.)
MOVED_MODULES = {
    "tasks.data": "tasks.inputs.loading",
    "tasks.sources": "tasks.models.sources",
    "tasks.generation": "tasks.models.generation",
    "tasks.packaging": "tasks.registry.packaging",
    "tasks.forgetting": "tasks.evaluation.forgetting",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import tasks.data`` gives the module it moved to (the same module object, not a copy)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}  # by alias: imports may run in threads

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias's spec on the real module: give it back its own.
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

# vLLM logs while it is imported (TRL imports it with its GRPO trainer): its records are routed before that.
importlib.import_module("tasks.models.vllm_logs").route_vllm_logging()
