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


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config(
    path: Path | None, overrides: list[str] | None = None, option: Path | None = None, **extra: Any
) -> PipelineConfig:
    """The config from CONFIG or --config (the same thing), ``--set`` overrides and explicit options."""
    if path is not None and option is not None and path != option:
        raise ConfigError(f"two configs given ({path} and --config {option}); give one")
    values = {k: _parse_value(v) for k, _, v in (item.partition("=") for item in overrides or [])}
    values.update({k: v for k, v in extra.items() if v is not None})
    chosen = path or option or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    config = load_config(chosen, values)
    notes.print(f"[dim]config: {chosen or '(defaults)'}[/dim]")
    return config


def _store(config: PipelineConfig, tracking_uri: str | None = None) -> str:
    """The MLflow store a command uses (--tracking-uri, else the config's), printed so nobody has to guess."""
    uri = tracking_uri or config.resolved_tracking_uri()
    notes.print(f"[dim]store: {uri}[/dim]")
    return uri


def _registry(config: Path | None, set_: list[str] | None, tracking_uri: str | None) -> Any:
    """The MLflow client of a registry command's store (printed), from --config/--set or --tracking-uri."""
    from tasks.registry import client_for

    return client_for(_store(_config(None, set_, config), tracking_uri))


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic", "mlflow.store", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _prefect_server() -> tuple[str | None, str]:
    """The Prefect API a run reports to and how to say so: PREFECT_API_URL, else a running ``grpoflow up``,
    else a temporary server whose runs stay in the Prefect home's database (``grpoflow up`` serves it)."""
    import os

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    from flows.services import running_up

    if PREFECT_API_URL.value():
        return None, f"Prefect: {PREFECT_API_URL.value()}"
    up = running_up()
    if up:
        return up["prefect_api_url"], f"Prefect: {up['prefect_api_url']} (grpoflow up)"
    home = os.path.expanduser(str(PREFECT_HOME.value()))
    return None, f"Prefect: a temporary local server; its runs stay in {home} (`grpoflow up` shows them)"


def _ui_base(tracking_uri: str) -> tuple[str, str]:
    """Where the MLflow UI for ``tracking_uri`` is, and a hint when it is not running yet."""
    from flows.services import running_up

    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/"), ""
    up = running_up()
    if up and up.get("store") == tracking_uri:
        return up["mlflow_url"], ""
    return "http://127.0.0.1:5000", " (after `grpoflow up` with this config)"


def print_links(summary: dict[str, Any]) -> None:
    """The pages a user wants after a run: the parent run among the training runs, and the registered version."""
    mlflow = summary.get("mlflow")
    if not mlflow:
        return
    base, hint = _ui_base(mlflow["tracking_uri"])
    from tasks.runs import run_page

    page = run_page(base, mlflow["experiment_id"], mlflow["parent_run_id"])
    console.print(f"MLflow run{hint}: {page}", soft_wrap=True)
    promotion = summary.get("promotion")
    if promotion:
        console.print(
            f"registered model: {base}/#/models/{promotion['registered_model']}/versions/{promotion['version']}"
        )


@app.command()
def run(
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    seed: Annotated[int | None, typer.Option(help="Override the config's seed.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Name of the run (default: generated).")] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="Resume this pipeline run (its folder under output_dir) with its saved config."),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Run the whole pipeline and print its summary; --resume RUN_ID continues a crashed run."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import new_run_id, pipeline
    from tasks.preflight import preflight
    from tasks.probe import NoLearningSignal

    _setup_logging()
    cfg = _config(config, set_, config_option, seed=seed)
    if resume:
        snapshot = RunLayout.of(cfg.output_dir, resume).config_snapshot
        if not snapshot.is_file():
            raise ConfigError(f"no pipeline run {resume!r} to resume: {snapshot} does not exist")
        cfg = PipelineConfig.model_validate_json(snapshot.read_text())
        from tasks.runs import finished_parent_run

        if finished_parent_run(cfg, resume):
            summary_path = RunLayout.of(cfg.output_dir, resume).summary_path
            console.print(f"run {resume} already finished: nothing to resume (its summary: {summary_path})")
            return
        console.print(f"resuming {resume}: finished stages come from the cache, trainers from their checkpoints")
    preflight(cfg)  # missing inputs fail here, before a server, a run or a model is started
    run_name = resume or run_id or new_run_id(cfg)
    api_url, where = _prefect_server()
    _store(cfg)
    notes.print(f"[dim]{where}[/dim]")
    console.print(f"[bold]grpoflow run[/bold] {run_name} → {RunLayout.of(cfg.output_dir, run_name).run_dir}")
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url} if api_url else {}):
            summary = pipeline(cfg, run_name)
    except NoLearningSignal as exc:
        console.print(f"[yellow]stopped before GRPO:[/yellow] {exc}")
        raise typer.Exit(3) from exc
    print_summary(summary)
    print_links(summary)


def _validated(cfg: PipelineConfig, show: bool = False) -> Any:
    """Run the validate stage into output_dir/validate for a standalone command; past the limits, a user error."""
    from tasks.validate import enforce_limits, run_validate

    result = run_validate(cfg, command_dir(cfg.output_dir, "validate"))
    if show:
        console.print_json(json.dumps(result.to_json()))
    enforce_limits(result, cfg)
    return result


@app.command()
def validate(config: ConfigArg = None, config_option: ConfigOption = None, set_: SetOption = None) -> None:
    """Run the validate stage alone; writes train / hold-out / quarantine files under output_dir/validate."""
    from tasks.preflight import preflight

    cfg = _config(config, set_, config_option)
    preflight(cfg)
    _validated(cfg, show=True)


@app.command()
def check(config: ConfigArg = None, config_option: ConfigOption = None, set_: SetOption = None) -> None:
    """Run every check that needs no model, then exit: the config, paths and model source, the data's columns
    and rows (the validate stage, with its quarantine), reward imports, and the tracking store."""
    from tasks.preflight import PreflightError, path_problems, tracking_problem

    cfg = _config(config, set_, config_option)  # the config's keys and its reward imports
    console.print("config and reward imports: ok")
    problems = path_problems(cfg)
    if problems:
        raise PreflightError("; ".join(problems))
    console.print("paths and model source: ok")
    result = _validated(cfg)
    console.print(
        f"data: ok ({result.rows_kept}/{result.rows_in} rows kept, {result.rows_train} train, "
        f"{result.rows_holdout} hold-out; quarantine: {result.quarantine_path})"
    )
    problem = tracking_problem(cfg)
    if problem:
        from tasks.runs import RegistryError

        raise RegistryError(problem)
    console.print(f"tracking store: ok ({_store(cfg)})")


@app.command()
def probe(
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    adapter: Annotated[Path | None, typer.Option(help="Probe base + this LoRA adapter folder.")] = None,
    set_: SetOption = None,
) -> None:
    """Probe the reward distribution of the base model (or base + adapter) on the train split."""
    from tasks.preflight import preflight
    from tasks.probe import gate_message, probe_verdict, run_probe, sample_completions
    from tasks.sources import resolve_model_source

    _setup_logging()
    cfg = _config(config, set_, config_option)
    preflight(cfg)
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


NameArg = Annotated[str, typer.Argument(help="Registered model name.")]
ModelArg = Annotated[str, typer.Argument(help="models:/NAME@ALIAS or models:/NAME/VERSION")]


@app.command()
def rollback(
    name: NameArg,
    to: Annotated[str | None, typer.Option("--to", help="Version to make champion (default: the one before).")] = None,
    reason: Annotated[str, typer.Option(help="Why; recorded in the history and on the version.")] = "manual rollback",
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Move champion back to the champion before it (or to --to VERSION); a plain rollback undoes the last move."""
    from flows.rollback import rollback_flow
    from tasks.registry import registered_model

    client = _registry(config, set_, tracking_uri)
    registered_model(client, name)  # a missing model is named before any flow or lock starts
    version = rollback_flow(client.tracking_uri, name, to, reason)
    console.print(f"{name}@champion → version {version}")


@app.command()
def versions(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Every version of a registered model with its aliases and headline metrics, newest first."""
    from tasks.champions import version_rows

    rows = version_rows(_registry(config, set_, tracking_uri), name)
    _print_table(f"{name}: {len(rows)} versions", rows)


@app.command()
def history(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """The champion's moves, oldest first: version, when, why, by which run or command."""
    from tasks.champions import reconcile

    moves, current = reconcile(_registry(config, set_, tracking_uri), name)
    rows = [{"#": str(m.seq), "version": m.version, "move": m.kind, "when": m.at or "-", "why": m.why, "by": m.by}
            for m in moves]  # fmt: skip
    _print_table(f"{name}@champion history (now: {'v' + current if current else 'none'})", rows)


@app.command()
def watch(
    name: Annotated[str | None, typer.Argument(help="Registered model name. Default: the config's.")] = None,
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Re-evaluate champion against the champion before it on the config's hold-out data; with
    watch.action=rollback, move it back when the earlier one is now better or the champion forgets too much."""
    from flows.watch import watch_flow

    _setup_logging()
    cfg = _config(None, set_, config, **{"tracking.tracking_uri": tracking_uri})
    _store(cfg)
    report = watch_flow(cfg, name)
    if report.get("skipped"):
        console.print(report["skipped"])
        return
    _print_table(f"{report['name']}@champion watch", report["table"])
    decision = report["decision"]
    colour = "green" if decision["status"] == "healthy" else "yellow"
    console.print(f"[{colour}]{decision['status']}[/{colour}]: {decision['reason']}", soft_wrap=True)
    for note in decision["notes"]:
        console.print(f"note: {note}", soft_wrap=True)


@app.command()
def pin(
    name: NameArg,
    version: Annotated[str, typer.Argument(help="The version to pin (normally the champion).")],
    reason: Annotated[str, typer.Option(help="Why; shown by the watch.")] = "pinned by hand",
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Pin a version: the champion watch reports on a pinned champion but never reverts it."""
    from tasks.watch import pin_champion

    pin_champion(_registry(config, set_, tracking_uri), name, version, reason)
    console.print(f"{name} v{version} pinned: {reason}")


@app.command()
def unpin(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Remove the pin: the champion watch may revert the champion again."""
    from tasks.watch import unpin_champion

    unpin_champion(_registry(config, set_, tracking_uri), name)
    console.print(f"{name}: no pin")


def _print_table(title: str, rows: list[dict[str, str]]) -> None:
    table = Table(title=title)
    for column in rows[0] if rows else ["(none)"]:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    # Piped output has no width to fit: keep each cell whole (a terminal still gets a table that fits it).
    (console if console.is_terminal else Console(width=200)).print(table)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The user prompt.")],
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS or models:/NAME/VERSION")],
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate (greedy decoding).")] = 64,
) -> None:
    """Answer a prompt with a registered adapter (base model read from the version's tag)."""
    import tempfile

    from tasks.data import render_prompt
    from tasks.generation import generate_completions
    from tasks.models import load_policy, load_tokenizer
    from tasks.registry import fetch_adapter
    from tasks.sources import resolve_model_source

    cfg = _config(None, set_, config)
    uri = _store(cfg, tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(uri, model, Path(scratch))
        base_dir = resolve_model_source(base)
        tokenizer = load_tokenizer(base_dir)
        policy = load_policy(base_dir, adapter_dir)
        text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], cfg.data.system_prompt)
        answer = generate_completions(
            policy, tokenizer, [text], greedy=True, max_new_tokens=max_new_tokens, precision=cfg.model.precision
        )[0][0]
    notes.print(f"[dim]{model} (version {version.version}, base {base})[/dim]")
    sys.stdout.write(answer + "\n")


@app.command()
def evaluate(
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS or models:/NAME/VERSION to evaluate alone.")],
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Evaluate a registered adapter alone on the config's hold-out split (and the base model beside it)."""
    from tasks.evaluate import ModelSpec, evaluation_table, run_evaluate
    from tasks.preflight import preflight
    from tasks.registry import fetch_adapter
    from tasks.sources import resolve_model_source

    _setup_logging()
    cfg = _config(config, set_, config_option)
    preflight(cfg)
    uri = _store(cfg, tracking_uri)
    data = _validated(cfg)
    scratch = command_dir(cfg.output_dir, "evaluate")
    base, adapter_dir, version = fetch_adapter(uri, model, scratch / "download")
    base_dir = resolve_model_source(base)
    models = {"base": ModelSpec("base", base_dir), "candidate": ModelSpec(f"v{version.version}", base_dir, adapter_dir)}
    result = run_evaluate(cfg, data.holdout_path, models, scratch)
    _print_table(f"{model} on {data.rows_holdout} hold-out rows", evaluation_table(result))
    console.print_json(json.dumps({"comparisons": result.comparisons, "forgetting": result.forgetting}))


@app.command()
def export(
    model: ModelArg,
    merged: Annotated[Path, typer.Option("--merged", help="Write base + adapter merged into this folder.")],
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Write a merged model folder (base weights with the adapter folded in) that transformers and vLLM load."""
    import tempfile

    from tasks.models import export_merged
    from tasks.registry import fetch_adapter

    uri = _store(_config(None, set_, config), tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(uri, model, Path(scratch))
        export_merged(base, adapter_dir, merged)
    console.print(f"{model} (version {version.version}) merged into {merged}")


@app.command()
def migrate(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Re-register versions registered as plain adapter folders as MLflow models (aliases move with them)."""
    import tempfile

    from tasks.registry import migrate_versions

    cfg = _config(None, set_, config)
    uri = _store(cfg, tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        moved = migrate_versions(uri, name, cfg.tracking.experiment_name, Path(scratch))
    console.print(", ".join(f"v{old} → v{new}" for old, new in moved.items()) or "nothing to migrate")


@app.command()
def up(
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    set_: SetOption = None,
    home: Annotated[
        Path | None, typer.Option(help="Folder for the servers' logs. Default: <output_dir>/services")
    ] = None,
    prefect_port: Annotated[int, typer.Option(help="Prefect server port on 127.0.0.1.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server port on 127.0.0.1.")] = 5000,
) -> None:
    """Serve the UIs of what runs wrote: MLflow over the config's store, Prefect over the Prefect home's runs.
    While it runs, grpoflow run reports to this Prefect server. Ctrl-C stops both."""
    import os

    from prefect.settings import PREFECT_HOME

    from flows.services import forget_up, record_up, start_services
    from tasks.locks import local_store_path

    cfg = _config(config, set_, config_option)
    uri = _store(cfg)
    if local_store_path(uri) is None or not uri.startswith("sqlite:"):
        raise ConfigError(f"the config tracks to {uri}: open its UI there; `grpoflow up` serves a local SQLite store")
    store_file = local_store_path(uri).resolve()
    folder = home or cfg.output_dir / "services"
    prefect_home = Path(os.path.expanduser(str(PREFECT_HOME.value())))
    store = (store_file, cfg.output_dir / "mlartifacts")
    services = start_services(folder, prefect_port, mlflow_port, mlflow_store=store, prefect_home=prefect_home)
    record_up(services, uri)
    console.print(f"Prefect UI  {services.prefect_url}   (runs in {prefect_home})\n"
                  f"MLflow UI   {services.mlflow_url}   (store {uri})\nlogs        {folder}")  # fmt: skip
    console.print(
        "grpoflow run/deploy on this machine now report here. For a worker, in another shell:\n"
        f"  export PREFECT_API_URL={services.prefect_api_url}\n"
        "  grpoflow deploy && GRPOFLOW_HOME=$PWD prefect worker start --pool grpoflow-cpu\n"
        "Ctrl-C stops both servers."
    )
    try:
        console.print(services.serve_until_stopped())
    finally:
        forget_up()


@app.command()
def deploy(
    prefect_file: Annotated[Path | None, typer.Option(help="Deployment file. Default: infra/prefect.yaml")] = None,
) -> None:
    """Register the deployments (nightly pipeline, rollback, GRPO) with the Prefect server at PREFECT_API_URL
    (or a running grpoflow up)."""
    import os

    from flows.services import PREFECT_FILE, running_up
    from flows.services import deploy as register

    up = running_up()
    env = {"PREFECT_API_URL": up["prefect_api_url"]} if up and not os.environ.get("PREFECT_API_URL") else None
    names = register(prefect_file or PREFECT_FILE, env)
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
