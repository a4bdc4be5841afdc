"""The ``grpoflow`` command: maps commands onto the flows and the stage functions.
Must not hold stage logic: it parses, calls a flow or a stage function, and prints."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

import tasks  # noqa: F401  (sets telemetry-off defaults before Prefect or MLflow load)
from flows.summary import print_summary
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.layout import RunLayout, command_dir

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,  # grpoflow's own errors are printed by main(); bugs keep their traceback
    help="grpoflow: validate → probe → SFT → GRPO → evaluate → promote. Exit codes: 0 done, 1 bug, 2 user "
    "error, 3 stopped by a gate, 4 infrastructure. --debug shows tracebacks.",
)
console = Console()
DEFAULT_CONFIG = Path("configs/demo.yaml")

ConfigArg = Annotated[Path | None, typer.Argument(help="Pipeline config (YAML). Default: configs/demo.yaml")]
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a key: --set grpo.max_steps=5")]


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config(path: Path | None, overrides: list[str] | None = None, **extra: Any) -> PipelineConfig:
    values = {k: _parse_value(v) for k, _, v in (item.partition("=") for item in overrides or [])}
    values.update({k: v for k, v in extra.items() if v is not None})
    chosen = path if path is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    try:
        return load_config(chosen, values)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic", "mlflow.store", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def run(
    config: ConfigArg = None,
    seed: Annotated[int | None, typer.Option(help="Override the config's seed.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Name of the run (default: generated).")] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="Resume this pipeline run (its folder under output_dir) with its saved config."),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Run the whole pipeline and print its summary; ``--resume RUN_ID`` continues a crashed run."""
    from flows.pipeline import new_run_id, pipeline
    from tasks.probe import NoLearningSignal

    _setup_logging()
    cfg = _config(config, set_, seed=seed)
    if resume:
        snapshot = RunLayout.of(cfg.output_dir, resume).config_snapshot
        if not snapshot.is_file():
            console.print(f"[red]no pipeline run {resume!r} to resume: {snapshot} does not exist[/red]")
            raise typer.Exit(2)
        cfg = PipelineConfig.model_validate_json(snapshot.read_text())
        from tasks.runs import finished_parent_run

        if finished_parent_run(cfg, resume):
            summary_path = RunLayout.of(cfg.output_dir, resume).summary_path
            console.print(f"run {resume} already finished: nothing to resume (its summary: {summary_path})")
            return
        console.print(f"resuming {resume}: finished stages come from the cache, trainers from their checkpoints")
    run_name = resume or run_id or new_run_id(cfg)
    console.print(f"[bold]grpoflow run[/bold] {run_name} → {RunLayout.of(cfg.output_dir, run_name).run_dir}")
    try:
        summary = pipeline(cfg, run_name)
    except NoLearningSignal as exc:
        console.print(f"[yellow]stopped before GRPO:[/yellow] {exc}")
        raise typer.Exit(3) from exc
    print_summary(summary)


def _validated(cfg: PipelineConfig, show: bool = False) -> Any:
    """Run the validate stage into ``output_dir/validate`` for a standalone command; exit 1 past the limits."""
    from tasks.validate import QuarantineLimitExceeded, enforce_limits, run_validate

    result = run_validate(cfg, command_dir(cfg.output_dir, "validate"))
    if show:
        console.print_json(json.dumps(result.to_json()))
    try:
        enforce_limits(result, cfg)
    except QuarantineLimitExceeded as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    return result


@app.command()
def validate(config: ConfigArg = None, set_: SetOption = None) -> None:
    """Run the validate stage alone; writes train / hold-out / quarantine files under output_dir/validate."""
    _validated(_config(config, set_), show=True)


@app.command()
def probe(
    config: ConfigArg = None,
    adapter: Annotated[Path | None, typer.Option(help="Probe base + this LoRA adapter folder.")] = None,
    set_: SetOption = None,
) -> None:
    """Probe the reward distribution of the base model (or base + adapter) on the train split."""
    from tasks.probe import gate_message, probe_verdict, run_probe, sample_completions
    from tasks.sources import resolve_model_source

    _setup_logging()
    cfg = _config(config, set_)
    data = _validated(cfg)
    label = "adapter" if adapter else "base"
    base_dir, stage_dir = resolve_model_source(cfg.model.source), command_dir(cfg.output_dir, "probe")
    result = run_probe(cfg, data.train_path, base_dir, adapter, stage_dir, label)
    message = gate_message(result, cfg.probe.min_signal_share, sample_completions(result))
    result.verdict = probe_verdict(result, message, gates=True)
    console.print_json(json.dumps(result.to_json()))
    if message:
        console.print(f"[yellow]{message}[/yellow]")
        raise typer.Exit(3)


@app.command()
def rollback(
    name: Annotated[str, typer.Argument(help="Registered model name.")],
    to: Annotated[str | None, typer.Option("--to", help="Version to make champion (default: previous).")] = None,
    reason: Annotated[str, typer.Option(help="Why; recorded on the version.")] = "manual rollback",
    config: Annotated[Path | None, typer.Option(help="Config whose tracking URI to use.")] = None,
) -> None:
    """Move ``champion`` back to the previous champion (or to --to VERSION)."""
    from flows.rollback import rollback_flow

    cfg = _config(config)
    version = rollback_flow(cfg.resolved_tracking_uri(), name, to, reason)
    console.print(f"{name}@champion → version {version}")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The user prompt.")],
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS or models:/NAME/VERSION")],
    config: Annotated[Path | None, typer.Option(help="Config whose tracking URI to use.")] = None,
    max_new_tokens: int = 64,
) -> None:
    """Answer a prompt with a registered adapter (base model read from the version's tag)."""
    from tasks.data import render_prompt
    from tasks.generation import generate_completions
    from tasks.models import load_policy, load_tokenizer
    from tasks.registry import fetch_adapter
    from tasks.sources import resolve_model_source

    cfg = _config(config)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(cfg.resolved_tracking_uri(), model, Path(scratch))
        base_dir = resolve_model_source(base)
        tokenizer = load_tokenizer(base_dir)
        policy = load_policy(base_dir, adapter_dir)
        text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], cfg.data.system_prompt)
        answer = generate_completions(
            policy, tokenizer, [text], greedy=True, max_new_tokens=max_new_tokens, precision=cfg.model.precision
        )[0][0]
    console.print(f"[dim]{model} (version {version.version}, base {base})[/dim]")
    sys.stdout.write(answer + "\n")


@app.command()
def evaluate(
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS or models:/NAME/VERSION to evaluate alone.")],
    config: ConfigArg = None,
    set_: SetOption = None,
) -> None:
    """Evaluate a registered adapter alone on the config's hold-out split (and the base model beside it)."""
    from tasks.evaluate import ModelSpec, evaluation_table, run_evaluate
    from tasks.registry import fetch_adapter
    from tasks.sources import resolve_model_source

    _setup_logging()
    cfg = _config(config, set_)
    data = _validated(cfg)
    scratch = command_dir(cfg.output_dir, "evaluate")
    base, adapter_dir, version = fetch_adapter(cfg.resolved_tracking_uri(), model, scratch / "download")
    base_dir = resolve_model_source(base)
    models = {"base": ModelSpec("base", base_dir), "candidate": ModelSpec(f"v{version.version}", base_dir, adapter_dir)}
    result = run_evaluate(cfg, data.holdout_path, models, scratch)
    table = Table(title=f"{model} on {data.rows_holdout} hold-out rows")
    rows = evaluation_table(result)
    for column in rows[0]:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    console.print(table)
    console.print_json(json.dumps({"comparisons": result.comparisons, "forgetting": result.forgetting}))


@app.command()
def export(
    model: Annotated[str, typer.Argument(help="models:/NAME@ALIAS or models:/NAME/VERSION")],
    merged: Annotated[Path, typer.Option("--merged", help="Write base + adapter merged into this folder.")],
    config: Annotated[Path | None, typer.Option(help="Config whose tracking URI to use.")] = None,
) -> None:
    """Write a merged model folder (base weights with the adapter folded in) that transformers and vLLM load."""
    import tempfile

    from tasks.models import export_merged
    from tasks.registry import fetch_adapter

    cfg = _config(config)
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(cfg.resolved_tracking_uri(), model, Path(scratch))
        export_merged(base, adapter_dir, merged)
    console.print(f"{model} (version {version.version}) merged into {merged}")


@app.command()
def migrate(
    name: Annotated[str, typer.Argument(help="Registered model name.")],
    config: Annotated[Path | None, typer.Option(help="Config whose tracking URI to use.")] = None,
) -> None:
    """Re-register versions registered as plain adapter folders as MLflow models (aliases move with them)."""
    import tempfile

    from tasks.registry import migrate_versions

    cfg = _config(config)
    with tempfile.TemporaryDirectory() as scratch:
        moved = migrate_versions(cfg.resolved_tracking_uri(), name, cfg.tracking.experiment_name, Path(scratch))
    console.print(", ".join(f"v{old} → v{new}" for old, new in moved.items()) or "nothing to migrate")


@app.command()
def up(
    config: ConfigArg = None,
    home: Annotated[
        Path | None, typer.Option(help="Data folder for both servers. Default: <output_dir>/services")
    ] = None,
    prefect_port: Annotated[int, typer.Option(help="Prefect server port on 127.0.0.1.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server port on 127.0.0.1.")] = 5000,
) -> None:
    """Start a Prefect server and an MLflow server on 127.0.0.1 (data under the output dir); Ctrl-C stops both."""
    from flows.services import ServiceError, start_services

    cfg = _config(config)
    folder = home or cfg.output_dir / "services"
    try:
        services = start_services(folder, prefect_port, mlflow_port)
    except ServiceError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    console.print(f"Prefect UI  {services.prefect_url}\nMLflow UI   {services.mlflow_url}\ndata        {folder}")
    console.print(
        "In another shell:\n"
        f"  export PREFECT_API_URL={services.prefect_api_url}\n"
        f"  grpoflow run --set tracking.tracking_uri={services.mlflow_url}\n"
        "  grpoflow deploy && GRPOFLOW_HOME=$PWD prefect worker start --pool grpoflow-cpu\n"
        "Ctrl-C stops both servers."
    )
    console.print(services.serve_until_stopped())


@app.command()
def deploy(
    prefect_file: Annotated[Path | None, typer.Option(help="Deployment file. Default: infra/prefect.yaml")] = None,
) -> None:
    """Register the deployments (nightly pipeline, rollback, GRPO) with the Prefect server at PREFECT_API_URL."""
    from flows.services import PREFECT_FILE, ServiceError
    from flows.services import deploy as register

    try:
        names = register(prefect_file or PREFECT_FILE)
    except ServiceError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    console.print("registered: " + ", ".join(names))
    console.print("start a worker: GRPOFLOW_HOME=$PWD prefect worker start --pool grpoflow-cpu")


WHAT_TO_DO = {
    2: "fix the input named above and run again",
    3: "the run stopped on purpose: see the message for what the data or rewards need",
    4: "fix the service, disk or lock named above; `grpoflow run --resume RUN_ID` continues a run",
}


class _NoUserErrorsOnConsole(logging.Filter):
    """Keep Prefect's log lines about a grpoflow error off the console: main() prints that error itself, in
    two lines (the Prefect UI still gets them, with the traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.errors import GrpoflowError

        return not (record.exc_info and isinstance(record.exc_info[1], GrpoflowError))


def main(argv: list[str] | None = None) -> None:
    """The ``grpoflow`` command: a grpoflow error prints what, where and what to do, and exits with its code
    (``tasks/errors.py``); ``--debug`` or ``GRPOFLOW_DEBUG=1`` shows the traceback instead."""
    import os

    from tasks.errors import GrpoflowError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("GRPOFLOW_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if not debug:  # Prefect's handlers exist once its logging is set up; later set-ups keep them
        from prefect.logging.configuration import setup_logging

        setup_logging()
        for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler):  # the console, not the API log handler
                    handler.addFilter(_NoUserErrorsOnConsole())
    try:
        app(args, prog_name="grpoflow")
    except GrpoflowError as exc:
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(f"error: {message}\n{WHAT_TO_DO.get(exc.exit_code, '')} (exit {exc.exit_code}; --debug "
                         "shows the traceback)\n")  # fmt: skip
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
