"""The servers and workers around runs: ``up`` (the MLflow and Prefect UIs), ``deploy`` (Prefect deployments),
``vllm-serve`` (a vLLM server for GRPO's server mode), ``serve`` (an OpenAI-compatible endpoint that follows a
registry alias) and ``node-agent`` (one node of a multi-node stage).
Must not import: a stage, torch or Prefect at import; must not hold service logic (``flows.services`` owns it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.common import (
    ConfigArg,
    ConfigOption,
    SetOption,
    TrackingOption,
    config_from,
    console,
    existing_store_uri,
    setup_logging,
    store_uri,
)
from tasks.config import ConfigError
from tasks.layout import command_dir


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
    """Serve the UIs of what runs wrote: MLflow over the config's store_uri, Prefect over the Prefect home's runs.
    While it runs, grpoflow run reports to this Prefect server. Ctrl-C stops both."""

    from prefect.settings import PREFECT_HOME

    from flows.services import forget_up, record_up, start_services
    from tasks.tracking import local_store_path

    cfg = config_from(config, set_, config_option)
    uri = store_uri(cfg)
    if local_store_path(uri) is None or not uri.startswith("sqlite:"):
        raise ConfigError(f"the config tracks to {uri}: open its UI there; `grpoflow up` serves a local SQLite store")
    store_file = local_store_path(uri).resolve()
    folder = home or cfg.output_dir / "services"
    prefect_home = Path(os.path.expanduser(str(PREFECT_HOME.value())))
    store = (store_file, cfg.output_dir / "mlartifacts")
    services = start_services(folder, prefect_port, mlflow_port, mlflow_store=store, prefect_home=prefect_home)
    record_up(services, uri)
    console.print(
        f"Prefect UI  {services.prefect_url}   (runs in {prefect_home})\n"
        f"MLflow UI   {services.mlflow_url}   (store {uri})\nlogs        {folder}"
    )
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


def deploy(
    config: ConfigArg = None,
    prefect_file: Annotated[Path | None, typer.Option(help="Deployment file. Default: infra/prefect.yaml")] = None,
    cron: Annotated[
        str,
        typer.Option(help="With CONFIG: when the pipeline runs (cron, five fields). Default: every night at 02:00."),
    ] = "0 2 * * *",
    name: Annotated[
        str | None, typer.Option(help="With CONFIG: the deployment's name. Default: nightly-<name>.")
    ] = None,
    pool: Annotated[str, typer.Option(help="With CONFIG: the work pool that runs it.")] = "grpoflow-cpu",
    timezone: Annotated[str, typer.Option(help="With CONFIG: the schedule's time zone.")] = "UTC",
) -> None:
    """Register deployments with the Prefect server at PREFECT_API_URL (or a running grpoflow up). Without CONFIG:
    those of infra/prefect.yaml (nightly pipeline, champion watch, rollback, GRPO, serving). With CONFIG: the
    pipeline on that config on its own schedule (--cron), as grpoflow-scheduled/nightly-<name>."""
    import tempfile

    from flows.services import PREFECT_FILE, running_up, schedule_file
    from flows.services import deploy as register

    up = running_up()
    env = {"PREFECT_API_URL": up["prefect_api_url"]} if up and not os.environ.get("PREFECT_API_URL") else None
    if config is not None:
        if prefect_file is not None:
            raise ConfigError("give CONFIG (a schedule of your own) or --prefect-file, not both")
        with tempfile.TemporaryDirectory() as scratch:
            file = Path(scratch) / "prefect.yaml"
            file.write_text(schedule_file(config, cron, name, pool, timezone))
            names = register(file, env)
    else:
        names = register(prefect_file or PREFECT_FILE, env)
    console.print("registered: " + ", ".join(names))
    console.print(
        f"start a worker: GRPOFLOW_HOME=$PWD prefect worker start --pool {pool if config else 'grpoflow-cpu'}"
    )


def vllm_serve(
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    set_: SetOption = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 on a GPU host that serves others).")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int | None, typer.Option(help="Port. Default: the port of grpo.generation.vllm_server_base_url, or 8000.")
    ] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the command instead of running it.")] = False,
    api_key_file: Annotated[
        Path | None,
        typer.Option(help="A file holding the API key (default: VLLM_API_KEY_FILE, else VLLM_API_KEY)."),
    ] = None,
    judge: Annotated[
        str | None,
        typer.Option(
            help="Serve this model as an LLM judge instead (a folder, a model source such as "
            "smollm2-135m-instruct, or a Hub id), named 'judge', without LoRA; prints the llm_judge reward's args."
        ),
    ] = None,
) -> None:
    """Serve the config's base model with vLLM for grpo.generation.vllm_mode: server. Adapters are loaded at run
    time (LoRA on, the config's dtype and context length); the folders GRPO writes must be readable here (same
    host, or a shared path). On an address other hosts reach it requires an API key (from a file or the
    environment, never the command line): runtime adapter loading reads any path the server sees. Ctrl-C stops it."""
    import shlex
    import signal
    import subprocess
    from urllib.parse import urlparse

    from reward_fns.judges.settings import is_loopback
    from tasks.errors import UserError
    from tasks.models import resolve_model_source, vllm_installed
    from tasks.models.sampling import pipeline_server_command
    from tasks.models.vllm_engine import INSTALL_HINT
    from tasks.models.vllm_server import api_key_from_environment

    cfg = config_from(config, set_, config_option)
    environ = {**os.environ, **({"VLLM_API_KEY_FILE": str(api_key_file)} if api_key_file else {})}
    api_key = api_key_from_environment(environ)
    if api_key is None and not is_loopback(host):
        raise UserError(
            f"vllm-serve on {host} serves other hosts, and loading adapters at run time lets a caller make it read "
            "any path it sees: give it an API key with VLLM_API_KEY, VLLM_API_KEY_FILE or --api-key-file"
        )
    url = cfg.grpo.generation.vllm_server_base_url
    port = port or (urlparse(url).port if url else None) or 8000
    if judge is not None:
        from reward_fns.judges import model_digest
        from tasks.models.sampling import judge_server_command

        judge_dir = resolve_model_source(judge)
        command, env, on_cpu = judge_server_command(cfg, judge_dir, host, port)
        reachable = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        judge_args = {
            "url": f"http://{reachable}:{port}/v1",
            "model": "judge",
            "model_digest": model_digest(str(judge_dir)),
        }
        if on_cpu:  # vLLM's CPU engine dies on a per-request seed (docs/judges.md): the cache keeps reruns equal
            judge_args["seed_requests"] = False
        if api_key:  # the judge reads the key the way this server got it: the same file, or the same variable
            key_file = environ.get("VLLM_API_KEY_FILE")
            judge_args |= (
                {"api_key_file": str(Path(key_file).resolve())} if key_file else {"api_key_env": "VLLM_API_KEY"}
            )
            if not is_loopback(reachable):
                judge_args["allow_key_over_http"] = True  # vLLM serves plain http: said below
        console.print(f"llm_judge args: {json.dumps(judge_args)}", soft_wrap=True)
        if judge_args.get("allow_key_over_http"):
            console.print(
                "note: vLLM serves plain http, so the judge's key crosses the network readable: keep it on a network "
                "you trust, or put a TLS proxy in front and give the judge its https URL"
            )
    else:
        command, env = pipeline_server_command(cfg, resolve_model_source(cfg.model.source), host, port)
    if print_only:
        console.print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(command), soft_wrap=True)
        return
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM's server reads it; its /v1 routes (adapter loading too) then need it
    if not vllm_installed():
        raise UserError(f"vLLM is not installed in this Python ({INSTALL_HINT})")
    from tasks.layout import command_dir
    from tasks.models import VllmServerClient, VllmServerUnavailable

    log_path = command_dir(cfg.output_dir, "vllm-serve") / f"server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    console.print(f"starting vLLM on http://{host}:{port} (its log: {log_path}) ...")
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)

    def stop(signum: int, frame: Any) -> None:  # `kill`, systemd, a script's trap: stopped as Ctrl-C stops it
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        try:  # "up" only once it answers: the engine takes tens of seconds to load after the process starts
            VllmServerClient(url, api_key=api_key).wait_until_up(600, alive=lambda: process.poll() is None)
        except VllmServerUnavailable as exc:
            what = "did not answer within 600 s" if process.poll() is None else f"exited ({process.poll()})"
            raise VllmServerUnavailable(f"vLLM {what} before it answered on {url}: its log is {log_path}") from exc
        what = "the llm_judge reward's url: /v1" if judge else "grpo.generation.vllm_server_base_url"
        console.print(f"vLLM server up on {url} ({what}); Ctrl-C stops it")
        code = process.wait()
    except KeyboardInterrupt:
        code = None
    finally:  # the server never outlives the command
        if process.poll() is None:
            process.terminate()
            process.wait()
    if code not in (None, 0, -15):
        raise SystemExit(code)


def serve(
    target: Annotated[
        str | None,
        typer.Argument(
            help="NAME@ALIAS (or NAME), or a config (YAML). Default: the config's registered model at serving.alias."
        ),
    ] = None,
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on. Default: serving.host (loopback).")] = None,
    port: Annotated[int | None, typer.Option(help="Port. Default: serving.port (8100).")] = None,
    engine: Annotated[
        str | None, typer.Option(help="vllm, transformers or auto. Default: serving.engine (auto).")
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            help="A file holding the API key (default: GRPOFLOW_SERVE_API_KEY_FILE, else GRPOFLOW_SERVE_API_KEY)."
        ),
    ] = None,
) -> None:
    """Serve a registered model's alias (champion by default) on an OpenAI-compatible endpoint (/v1/chat/completions,
    /v1/completions, /v1/models, /health, /metrics) and follow it: when the alias moves (promotion, rollback, the
    watch's rollback) the new version is checked (adapter digest, smoke answers) and then answers new requests.
    Beyond loopback it requires an API key (from a file or the environment). Ctrl-C stops it."""
    from tasks.serving import api_key_from, serving_target
    from tasks.serving import serve as run_server

    setup_logging()
    if target and target.endswith((".yaml", ".yml")):  # `grpoflow serve CONFIG`: the config's model and alias
        target, config = None, config or Path(target)
    cfg = config_from(None, set_, config)
    uri = existing_store_uri(cfg, tracking_uri)
    name, alias = serving_target(target, cfg.tracking.registered_model_name, cfg.serving.alias)
    if engine not in (None, "auto", "vllm", "transformers"):
        raise ConfigError(f"--engine must be auto, vllm or transformers, got {engine!r}")
    run_server(
        cfg,
        uri,
        name,
        alias,
        host or cfg.serving.host,
        port or cfg.serving.port,
        api_key_from(dict(os.environ), api_key_file),
        engine or cfg.serving.engine,
        command_dir(cfg.output_dir, "serve") / f"{name}-{alias}",
    )


def node_agent(
    tracking_uri: Annotated[str, typer.Option(help="The MLflow tracking server every node reaches.")],
    stage_run: Annotated[str, typer.Option(help="The stage's MLflow run id (it holds the launch request).")],
    manifest: Annotated[
        str, typer.Option(help="The digest of the stage's sealed manifest (the launcher writes it; never from MLflow).")
    ],
    node_rank: Annotated[
        int | None, typer.Option(help="This node's rank. Default: SLURM_PROCID, PET_NODE_RANK or GRPOFLOW_NODE_RANK.")
    ] = None,
    rendezvous_host: Annotated[str | None, typer.Option(help="Node 0's address (default: the request's).")] = None,
    local_addr: Annotated[str | None, typer.Option(help="This node's own address (torchrun's --local-addr).")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Node-local scratch (default: a temporary folder).")] = None,
) -> None:
    """Run one node's part of a multi-node SFT or GRPO stage (orchestration.nodes > 1): fetch the stage's request
    and inputs from MLflow, start this machine's ranks, report back through MLflow. The stage prints this command
    for each node with orchestration.launcher: manual; Slurm and Kubeflow jobs run it for you."""
    import shutil
    import tempfile

    from tasks.training.nodes import NodeInputError, run_agent
    from tasks.training.nodes.agent import node_rank_from_environment

    node = node_rank if node_rank is not None else node_rank_from_environment()
    if node is None:
        raise NodeInputError("no --node-rank, and no SLURM_PROCID or PET_NODE_RANK to take it from")
    scratch = workdir or Path(tempfile.mkdtemp(prefix=f"grpoflow-node-{node}-"))
    try:
        code = run_agent(tracking_uri, stage_run, node, scratch, manifest, rendezvous_host, local_addr)
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if code:
        console.print(f"node {node}: its ranks exited with code {code}; the stage reports why")
        raise SystemExit(code)
