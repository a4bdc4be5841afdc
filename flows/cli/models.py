"""Using a registered version: ``generate``, ``evaluate``, ``export``.
Must not import: a stage, torch or Prefect at import; must not hold stage logic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import (
    ConfigArg,
    ConfigOption,
    ModelArg,
    SetOption,
    TrackingOption,
    config_from,
    console,
    existing_store_uri,
    notes,
    print_table,
    setup_logging,
    validated,
)
from tasks.layout import command_dir


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

    from tasks.inputs import render_prompt
    from tasks.models import generate_completions, load_policy, load_tokenizer, resolve_model_source
    from tasks.registry import fetch_adapter

    cfg = config_from(None, set_, config)
    uri = existing_store_uri(cfg, tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(uri, model, Path(scratch))
        base_dir = resolve_model_source(base)
        tokenizer = load_tokenizer(base_dir)
        policy = load_policy(base_dir, adapter_dir, precision=cfg.model.precision)
        text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], cfg.data.system_prompt)
        answer = generate_completions(
            policy, tokenizer, [text], greedy=True, max_new_tokens=max_new_tokens, precision=cfg.model.precision
        )[0][0]
    notes.print(f"[dim]{model} (version {version.version}, base {base})[/dim]")
    sys.stdout.write(answer + "\n")


def evaluate(
    model: Annotated[str, typer.Option(help="models:/NAME@ALIAS or models:/NAME/VERSION to evaluate alone.")],
    config: ConfigArg = None,
    config_option: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Evaluate a registered adapter alone on the config's hold-out split (and the base model beside it)."""
    from tasks.evaluate import ModelSpec, run_evaluate
    from tasks.evaluation import evaluation_table
    from tasks.models import resolve_model_source
    from tasks.preflight import preflight
    from tasks.registry import fetch_adapter

    setup_logging()
    cfg = config_from(config, set_, config_option)
    preflight(cfg)
    uri = existing_store_uri(cfg, tracking_uri)
    data = validated(cfg)
    scratch = command_dir(cfg.output_dir, "evaluate")
    base, adapter_dir, version = fetch_adapter(uri, model, scratch / "download")
    base_dir = resolve_model_source(base)
    models = {"base": ModelSpec("base", base_dir), "candidate": ModelSpec(f"v{version.version}", base_dir, adapter_dir)}
    result = run_evaluate(cfg, data.holdout_path, models, scratch)
    print_table(f"{model} on {data.rows_holdout} hold-out rows", evaluation_table(result))
    console.print_json(json.dumps({"comparisons": result.comparisons, "forgetting": result.forgetting}))


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

    uri = existing_store_uri(config_from(None, set_, config), tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        base, adapter_dir, version = fetch_adapter(uri, model, Path(scratch))
        export_merged(base, adapter_dir, merged)
    console.print(f"{model} (version {version.version}) merged into {merged}")
