"""What every ``grpoflow`` command shares: the Typer app, the console, the option types, and how a command finds
its config, store and registry (and says which it used, on stderr, so stdout stays the result).
Must not import: a stage, torch or Prefect (every command imports it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import tasks  # noqa: F401  (sets telemetry-off defaults before Prefect or MLflow load)
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.layout import command_dir

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,  # grpoflow's own errors are printed by main(); bugs keep their traceback
    help="grpoflow: validate → probe → SFT → GRPO → evaluate → promote. Exit codes: 0 done, 1 bug, 2 user "
    "error, 3 stopped by a gate, 4 infrastructure. --debug shows tracebacks; --quiet only warnings, errors and "
    "the result; --verbose every log line.",
)
console = Console()
# Where a command says which config, store and server it used: stderr, so stdout stays the result.
notes = Console(stderr=True, soft_wrap=True)
DEFAULT_CONFIG = Path("configs/demo.yaml")

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Pipeline config (YAML); same as --config. Default: configs/demo.yaml")
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Pipeline config (YAML): its tracking store is used. Default: configs/demo.yaml"
    ),
]
TrackingOption = Annotated[
    str | None, typer.Option("--tracking-uri", help="MLflow tracking URI; overrides the config's store.")
]
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set grpo.max_steps=5")]

NameArg = Annotated[str, typer.Argument(help="Registered model name.")]
ModelArg = Annotated[str, typer.Argument(help="models:/NAME@ALIAS or models:/NAME/VERSION")]


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def config_from(
    path: Path | None, overrides: list[str] | None = None, option: Path | None = None, **extra: Any
) -> PipelineConfig:
    """The config from CONFIG or --config (the same thing), ``--set`` overrides and explicit options."""
    if path is not None and option is not None and path != option:
        raise ConfigError(f"two configs given ({path} and --config {option}); give one")
    values = {k: parse_value(v) for k, _, v in (item.partition("=") for item in overrides or [])}
    values.update({k: v for k, v in extra.items() if v is not None})
    chosen = path or option or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    config = load_config(chosen, values)
    notes.print(f"[dim]config: {chosen or '(defaults)'}[/dim]")
    return config


def store_uri(config: PipelineConfig, tracking_uri: str | None = None) -> str:
    """The MLflow store a command uses (--tracking-uri, else the config's), printed so nobody has to guess."""
    uri = tracking_uri or config.resolved_tracking_uri()
    notes.print(f"[dim]store: {uri}[/dim]")
    return uri


def existing_store_uri(config: PipelineConfig, tracking_uri: str | None = None) -> str:
    """``store_uri`` for a command that reads the registry: a local store that does not exist is an error here
    (a registry command never creates one)."""
    from tasks.config import ConfigError
    from tasks.tracking import local_store_path

    uri = store_uri(config, tracking_uri)
    local = local_store_path(uri)
    if local is not None and not local.exists():
        raise ConfigError(
            f"no tracking store at {local} (nothing has run with this config's output_dir yet): "
            "give the run's config with --config, or --tracking-uri"
        )
    return uri


def registry_client(config: Path | None, set_: list[str] | None, tracking_uri: str | None) -> Any:
    """The MLflow client of a registry command's existing store (printed), from --config/--set or
    --tracking-uri."""
    from tasks.registry import client_for

    return client_for(existing_store_uri(config_from(None, set_, config), tracking_uri))


# The console mode a command runs in (quiet, normal, verbose), for this process and the ranks it starts.
CONSOLE_ENV = "GRPOFLOW_CONSOLE"
# Libraries whose info lines a user cannot act on; the console shows their warnings and errors only.
NOISY_LOGGERS = ("httpx", "alembic", "mlflow.store", "mlflow.pyfunc", "mlflow.models", "great_expectations")


class LibraryChatterFilter(logging.Filter):
    """Drop the info lines of ``NOISY_LOGGERS`` and their children from a console handler, and the lines that
    repeat the progress bar (``SHOWN_ON_THE_BAR``). A level on the logger is not enough: Great Expectations sets
    its docs-site logger to INFO when that module is imported."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.tracking.progress import SHOWN_ON_THE_BAR

        if record.levelno >= logging.WARNING:
            return True
        return not record.name.startswith(NOISY_LOGGERS) and not getattr(record, SHOWN_ON_THE_BAR, False)


def setup_logging() -> None:
    """The console's log lines at the level ``--quiet`` / ``--verbose`` chose (``GRPOFLOW_CONSOLE``): quiet shows
    warnings and errors only; verbose adds grpoflow's debug lines and the libraries' own info lines."""
    import os

    mode = os.environ.get(CONSOLE_ENV, "normal")
    level = {"quiet": logging.WARNING, "verbose": logging.DEBUG}.get(mode, logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if mode == "verbose":
        for package in ("tasks", "reward_fns", "flows"):
            logging.getLogger(package).setLevel(logging.DEBUG)
        return
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def validated(cfg: PipelineConfig, show: bool = False, folder: Path | None = None) -> Any:
    """Run the validate stage into ``folder`` (default output_dir/validate) for a standalone command; past the
    limits, a user error."""
    from tasks.validate import enforce_judges, enforce_limits, run_validate

    stage_dir = folder or command_dir(cfg.output_dir, "validate")
    result = run_validate(cfg, stage_dir)
    if show:
        console.print_json(json.dumps(result.to_json()))
    enforce_limits(result, cfg)
    enforce_judges(result, stage_dir)
    return result


def print_table(title: str, rows: list[dict[str, str]]) -> None:
    """A table of rows (all of one shape); without rows, the title and "(none)" on one line (an empty table would
    squeeze the title into a one-word-wide column)."""
    if not rows:
        console.print(f"{title}: (none)", soft_wrap=True)
        return
    table = Table(title=title)
    for column in rows[0]:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    # Piped output has no width to fit: keep each cell whole (a terminal still gets a table that fits it).
    (console if console.is_terminal else Console(width=200)).print(table)
