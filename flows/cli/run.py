"""``grpoflow run``, ``check``, ``validate``, ``probe``: the pipeline and its first stages from the command line.
Must not import: a stage, torch or Prefect at import; must not hold stage logic.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.common import (
    ConfigArg,
    ConfigOption,
    SetOption,
    config_from,
    console,
    notes,
    setup_logging,
    store_uri,
    validated,
)
from flows.summary import print_summary
from tasks.config import ConfigError, PipelineConfig
from tasks.layout import RunLayout, command_dir


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
    from tasks.preflight import preflight

    setup_logging()
    cfg = config_from(config, set_, config_option, seed=seed)
    if resume:
        snapshot = RunLayout.of(cfg.output_dir, resume).config_snapshot
        if not snapshot.is_file():
            raise ConfigError(f"no pipeline run {resume!r} to resume: {snapshot} does not exist")
        cfg = PipelineConfig.model_validate_json(snapshot.read_text())
        from tasks.tracking import finished_parent_run

        if finished_parent_run(cfg, resume):
            summary_path = RunLayout.of(cfg.output_dir, resume).summary_path
            console.print(f"run {resume} already finished: nothing to resume (its summary: {summary_path})")
            return
        console.print(f"resuming {resume}: finished stages come from the cache, trainers from their checkpoints")
    preflight(cfg, tracking=True)  # missing inputs fail here, before a server, a run or a model is started
    from tasks.models import prepare_in_background
    from tasks.speedups import speedups_on

    # On the core the start-up leaves idle: SmolLM2's first conversion, and the temporary Prefect server's boot.
    prepare_in_background(cfg.model.source)
    api_url, where = _prefect_server()
    early_server = None
    if api_url is None and speedups_on(cfg.grpo.speedups):
        from tasks.speedups.prefect_server import start_early

        early_server = start_early()
    # The stack (torch, TRL, Prefect, MLflow: ~10 s) is imported once the inputs are known to be there, so a
    # user's mistake is named in a second or two.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import new_run_id, pipeline
    from tasks.probe import NoLearningSignal

    run_name = resume or run_id or new_run_id(cfg)
    store_uri(cfg)
    notes.print(f"[dim]{where}[/dim]")
    console.print(f"[bold]grpoflow run[/bold] {run_name} → {RunLayout.of(cfg.output_dir, run_name).run_dir}")
    if early_server is not None:
        early_server.join()  # up by now; the flow's first API call finds it
    hint = resume_hint(run_name, config or config_option)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url} if api_url else {}), hint_when_killed(hint):
            summary = pipeline(cfg, run_name)
    except NoLearningSignal as exc:
        console.print(f"[yellow]stopped before GRPO:[/yellow] {exc}")
        raise typer.Exit(3) from exc
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted: {hint}\n")
        raise typer.Exit(130) from None
    print_summary(summary)
    print_links(summary)


def resume_hint(run_name: str, config: Path | None) -> str:
    """What to run to continue a run that was stopped.

    >>> resume_hint("demo-1", Path("configs/demo.yaml")).split(" continues")[0]
    '`grpoflow run configs/demo.yaml --resume demo-1`'
    """
    command = shlex.join(["grpoflow", "run", *([str(config)] if config else []), "--resume", run_name])
    return f"`{command}` continues it (finished stages from the cache, trainers from their last checkpoint)"


@contextmanager
def hint_when_killed(hint: str) -> Iterator[None]:
    """On SIGTERM, say how to resume, then end as the signal ends a process (exit 143). Prefect's engine turns a
    SIGTERM inside a task into a crashed task and sends it again to the handler it found, this one."""

    def on_term(signum: int, frame: Any) -> None:
        sys.stderr.write(f"\nkilled (SIGTERM): {hint}\n")
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def validate(config: ConfigArg = None, config_option: ConfigOption = None, set_: SetOption = None) -> None:
    """Run the validate stage alone; writes train / hold-out / quarantine files under output_dir/validate."""
    from tasks.preflight import preflight

    cfg = config_from(config, set_, config_option)
    preflight(cfg)
    validated(cfg, show=True)


def check(config: ConfigArg = None, config_option: ConfigOption = None, set_: SetOption = None) -> None:
    """Run every check that needs no model, then exit: the config, paths and model source, the data's columns
    and rows (the validate stage, with its quarantine reasons), reward imports, and the tracking store. It writes
    nothing: the split goes to a temporary folder, and a local store that does not exist yet is not created."""
    import tempfile

    from tasks.preflight import PreflightError, generation_problem, nodes_problem, path_problems, tracking_problem
    from tasks.tracking import local_store_path

    cfg = config_from(config, set_, config_option)  # the config's keys and its reward imports
    console.print("config and reward imports: ok")
    problems = path_problems(cfg)
    if problems:
        raise PreflightError("; ".join(problems))
    console.print("paths and model source: ok")
    problem = nodes_problem(cfg)  # several nodes: a store every node reaches
    if problem:
        raise PreflightError(problem)
    problem = generation_problem(cfg)  # the same check `run` makes: vLLM missing, a server that does not answer
    if problem:
        raise PreflightError(problem)
    from tasks.models import pipeline_engine

    console.print(f"generation: ok ({pipeline_engine(cfg)})")
    from tasks.models.hardware import this_machine, what_runs

    machine = this_machine()
    console.print(f"hardware: {machine.describe()}")
    console.print(f"uses: {what_runs(cfg, machine)}")
    with tempfile.TemporaryDirectory(prefix="grpoflow-check-") as scratch:
        result = validated(cfg, folder=Path(scratch))
    reasons = ", ".join(
        f"{reason} ×{count}" for reason, count in sorted(result.reasons.items(), key=lambda item: -item[1])[:3]
    )
    console.print(
        f"data: ok ({result.rows_kept}/{result.rows_in} rows kept, {result.rows_train} train, "
        f"{result.rows_holdout} hold-out; {result.rows_quarantined} quarantined{': ' + reasons if reasons else ''})"
    )
    if result.sandbox:
        console.print(f"sandbox for model-written code: ok ({result.sandbox}; a planted host file stayed unseen)")
    if result.tools:
        console.print(
            f"tools: ok ({', '.join(result.tools['tools']['methods'])}: {result.tools['canaries']} canaries passed; "
            f"{result.tools.get('sizes_summary', 'no rows to size')}; template: {result.tools.get('template', '-')})"
        )
    uri = store_uri(cfg)
    local = local_store_path(uri)
    if local is not None and not local.exists():
        console.print(f"tracking store: ok (a new local store, created at {local} by the first run)")
        return
    problem = tracking_problem(cfg)
    if problem:
        from tasks.tracking import RegistryError

        raise RegistryError(problem)
    console.print(f"tracking store: ok ({uri})")


def probe(
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    adapter: Annotated[Path | None, typer.Option(help="Probe base + this LoRA adapter folder.")] = None,
    set_: SetOption = None,
) -> None:
    """Probe the reward distribution of the base model (or base + adapter) on the train split."""
    from tasks.models import resolve_model_source
    from tasks.preflight import preflight
    from tasks.probe import gate_message, probe_verdict, run_probe, sample_completions

    setup_logging()
    cfg = config_from(config, set_, config_option)
    preflight(cfg)
    data = validated(cfg)
    label = "adapter" if adapter else "base"
    base_dir, stage_dir = resolve_model_source(cfg.model.source), command_dir(cfg.output_dir, "probe")
    result = run_probe(cfg, data.train_path, base_dir, adapter, stage_dir, label)
    message = gate_message(result, cfg.probe.min_signal_share, sample_completions(result))
    result.verdict = probe_verdict(result, message, gates=True)
    console.print_json(json.dumps(result.to_json()))
    if message:
        console.print(f"[yellow]{message}[/yellow]")
        raise typer.Exit(3)


def _prefect_server() -> tuple[str | None, str]:
    """The Prefect API a run reports to and how to say so: PREFECT_API_URL, else a running ``grpoflow up``,
    else a temporary server whose runs stay in the Prefect home's database (``grpoflow up`` serves it)."""

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
    from tasks.tracking import run_page

    page = run_page(base, mlflow["experiment_id"], mlflow["parent_run_id"])
    console.print(f"MLflow run{hint}: {page}", soft_wrap=True)
    promotion = summary.get("promotion")
    if promotion:
        console.print(
            f"registered model: {base}/#/models/{promotion['registered_model']}/versions/{promotion['version']}"
        )
