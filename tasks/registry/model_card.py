"""The model card of a registered version: what it was trained on and how, how it scored beside the base model,
the SFT policy and the previous champion, what promotion decided, samples, and how to load it. Built with
``huggingface_hub``'s ``ModelCard``/``ModelCardData``, so it is also a valid card on the Hub.
Must not import: Prefect, MLflow, torch.
"""

from __future__ import annotations

from typing import Any

from tasks.config import PipelineConfig, changed_settings
from tasks.evaluation import describe

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Task and data
{{ data }}

## Training recipe
{{ recipe }}
{% if tools %}
## Tools
{{ tools }}
{% endif %}
## Probes
{{ probes }}

## Evaluation
{{ evaluation }}

## Promotion
{{ promotion }}

## Samples
{{ samples }}

## How to load it
{{ loading }}
"""


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def _table(evaluation: Any) -> str:
    ks = sorted({k for score in evaluation.scores.values() for k in score.pass_at_k})
    head = "| model | greedy | " + " | ".join(f"pass@{k}" for k in ks) + " | pass@1 95 % CI | general QA | ppl |"
    rule = "|---" * (len(ks) + 5) + "|"
    rows = []
    for name, score in evaluation.scores.items():
        low, high = score.pass1_interval
        general = score.general
        rows.append(
            f"| {name} | {_percent(score.greedy_accuracy)} | "
            + " | ".join(_percent(score.pass_at_k.get(k)) for k in ks)
            + f" | [{_percent(low)}, {_percent(high)}] | {_percent(general.qa_accuracy if general else None)} | "
            + (f"{general.perplexity:.2f} |" if general else "— |")
        )
    comparisons = "\n".join(
        f"- {key}: sampled pass@1 {100 * d['mean']:+.1f} points, paired 95 % CI "
        f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] (n={d['n']} prompts)"
        for key, d in evaluation.comparisons.items()
    )
    forgot = "".join(
        f"\n\nForgetting against {against} (95 % CIs): {describe(drop)}."
        for against, drop in (
            ("the base model", evaluation.forgetting),
            ("the champion", getattr(evaluation, "forgetting_reference", None)),
        )
        if drop
    )
    engine = f"\n\nCompletions sampled by: {evaluation.engine}."
    tables = comparisons + forgot + engine + _extraction_table(evaluation) + _tool_table(evaluation)
    return "\n".join([head, rule, *rows]) + "\n\n" + tables


def _extraction_table(evaluation: Any) -> str:
    """The answer extractions published results use (``evaluation.extractions``), per model; empty without."""
    names = sorted({name for score in evaluation.scores.values() for name in getattr(score, "extractions", {})})
    if not names:
        return ""
    head = "| model | " + " | ".join(f"{name} greedy | {name} pass@1" for name in names) + " |"
    rows = [
        f"| {model} | "
        + " | ".join(
            f"{_percent(score.extractions.get(name, {}).get('greedy'))} | "
            f"{_percent(score.extractions.get(name, {}).get('pass_at_1'))}"
            for name in names
        )
        + " |"
        for model, score in evaluation.scores.items()
    ]
    return (
        "\n\nAnswers read as published GSM8K results read them (strict: the number after `####`; flexible: the "
        "last number), beside the rewards:\n\n" + "\n".join([head, "|---" * (2 * len(names) + 1) + "|", *rows])
    )


def _tool_table(evaluation: Any) -> str:
    """With tools: each model with and without them, and the paired gain the tools give (empty without tools)."""
    from tasks.evaluation.report import tool_columns

    columns = {name: tool_columns(score) for name, score in evaluation.scores.items()}
    if not any(columns.values()):
        return ""
    lines = [
        "\n\nWith and without the tools (the same prompts, paired):\n",
        "| model | greedy with | greedy without | pass@1 with | pass@1 without | tool gain, pass@1 (95 % CI) | "
        "calls / rollout | tool errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, score in evaluation.scores.items():
        c = columns[name]
        if c:
            lines.append(
                f"| {name} | {_percent(score.greedy_accuracy)} | {_percent(c['greedy without tools'])} | "
                f"{_percent(score.pass_at_k.get(1))} | {_percent(c['pass@1 without tools'])} | "
                f"{c['tool gain pass@1 (95% CI)']} | {c['tool calls per rollout']:.2f} | "
                f"{_percent(c['tool error share'])} |"
            )
    return "\n".join(lines)


def tools_text(config: Any) -> str:
    """The card's tools section: each tool, its limits, and the per-rollout limits (empty without tools).

    >>> from types import SimpleNamespace
    >>> from tasks.config import ToolSettings
    >>> text = tools_text(SimpleNamespace(tools=ToolSettings(use=[{"name": "python"}])))
    >>> text.splitlines()[0].startswith("- `python` (built-in: runs the model's code in the sandbox")
    True
    """
    tools = config.tools
    if not tools.enabled:
        return ""
    lines = []
    for spec in tools.use:
        if spec.name == "python":
            limits = ", ".join(f"{key} {value}" for key, value in spec.python_args().items())
            lines.append(
                f"- `{spec.label}` (built-in: runs the model's code in the sandbox, no network, no host "
                f"files; {limits})"
            )
        else:
            lines.append(f"- `{spec.label}` (`{spec.name}`" + (f", args {spec.args}" if spec.args else "") + ")")
    lines.append(
        f"- per rollout: at most {tools.max_turns} tool turns, {tools.max_calls} calls, {tools.max_seconds:g} s of "
        f"tool time, {tools.max_output_bytes} bytes of tool output fed back; each call times out after "
        f"{tools.call_timeout_s:g} s; {'one interpreter session per rollout' if tools.session else 'no session'}; "
        f"chat template `{tools.chat_template}`"
    )
    lines.append(
        "- the model calls them while it answers (TRL's tool loop in GRPO; grpoflow's own loop in probe and "
        "evaluation); the tools' answers are never trained on"
    )
    return "\n".join(lines)


def version_card(
    *,
    config: PipelineConfig,
    registered_model: str,
    role: str,
    data: Any,
    probes: dict[str, Any],
    evaluation: Any,
    decision: str,
    run_id: str,
    selection: Any = None,
) -> tuple[str, str]:
    """The card of the version holding the model that had ``role`` in the evaluation (``candidate``: the final
    adapter; ``sft``: the SFT-stage backup), as markdown with Hub front matter; and its one-paragraph summary.
    ``selection``: which GRPO step's adapter it is and why (``tasks.training.Selection``), when recorded."""
    from huggingface_hub import ModelCard, ModelCardData

    scores = evaluation.of(role)
    name = registered_model if role == "candidate" else f"{registered_model}-sft"
    card_data = ModelCardData(
        base_model=config.model.source,
        library_name="peft",
        pipeline_tag="text-generation",
        tags=["grpoflow", "lora", "trl", "grpo" if role == "candidate" else "sft", f"task-{config.data.kind}"]
        + (["tool-use"] if config.tools.enabled else []),
    )
    stage = "SFT then GRPO" if role == "candidate" else "SFT (the backup of the adapter GRPO continued)"
    low, high = scores.pass1_interval
    summary = (
        f"A LoRA adapter for `{config.model.source}` trained by grpoflow ({stage}) in pipeline run `{run_id}`. "
        f"{'Test set' if config.data.test_source else 'Hold-out'}: greedy accuracy {_percent(scores.greedy_accuracy)}, "
        f"sampled pass@1 {_percent(scores.pass_at_k.get(1))} [{_percent(low)}, {_percent(high)}] on "
        f"{scores.n_prompts} prompts."
    )
    test = getattr(data, "test", None) or {}
    data_text = (
        f"- kind `{config.data.kind}`, source `{config.data.source}`, fingerprint `{data.fingerprint}`\n"
        + (
            f"- MLflow datasets: `train` digest `{data.train_digest}`, `holdout` digest `{data.holdout_digest}`\n"
            if getattr(data, "train_digest", "")
            else ""
        )
        + f"- {data.rows_in} rows in: {data.rows_kept} kept, {data.rows_quarantined} quarantined; "
        f"{data.rows_train} train / {data.rows_holdout} hold-out\n"
        + (
            f"- evaluated on the test source `{test['source']}`: {test['rows_kept']} of {test['rows_in']} rows kept; "
            f"{test.get('leaks', 0)} training rows whose prompt it holds were quarantined as leaks\n"
            if test
            else "- evaluated on the hold-out split carved from the training data\n"
        )
        + "- rewards: "
        + ", ".join(f"`{r.name}` × {r.weight:g}" for r in config.rewards)
    )
    recipe = (
        f"- LoRA r={config.lora.r}, alpha={config.lora.alpha}, dropout={config.lora.dropout}, "
        f"targets `{config.lora.target_modules}`; precision `{config.model.precision}`; seed {config.seed}\n"
        f"- SFT: {config.sft.max_steps} steps × {config.sft.batch_size}, learning rate {config.sft.learning_rate:g}\n"
        + (
            f"- GRPO: {config.grpo.max_steps} steps × {config.grpo.batch_size} completions "
            f"({config.grpo.num_generations} per prompt, ≤ {config.grpo.max_completion_length} tokens, "
            f"temperature {config.grpo.temperature:g}), learning rate {config.grpo.learning_rate:g}, "
            f"beta {config.grpo.beta:g}, loss `{config.grpo.loss_type}`"
            + "".join(f", `{name}` {value}" for name, value in changed_settings(config.grpo).items())
            + (
                f"\n- the adapter of GRPO step {selection.step} of {selection.last_step}: {selection.reason}"
                if selection
                else ""
            )
            if role == "candidate"
            else "- GRPO: continued this adapter into the main version"
        )
    )
    probes_text = "\n".join(f"- {label}: {probe.verdict}" for label, probe in probes.items()) or "- (probe off)"
    samples = (
        "\n".join(
            f"- {'✓' if sample['correct'] else '✗'} **{sample['prompt'][:200]}** → `{sample['completion'][:200]}`"
            for sample in scores.samples
        )
        or "- (none recorded)"
    )
    loading = (
        f'```python\nimport mlflow\nmodel = mlflow.pyfunc.load_model("models:/{name}@champion")  # or /VERSION\n'
        f'model.predict(["{_example_prompt(scores)}"], params={{"max_new_tokens": 64}})\n```\n\n'
        f'```bash\ngrpoflow generate --model models:/{name}@champion "{_example_prompt(scores)}"\n'
        f"mlflow models serve -m models:/{name}@champion --env-manager local -h 127.0.0.1 -p 5001\n```\n\n"
        "With transformers and PEFT: the adapter files are in the version's `artifacts/adapter/`; load "
        f"the base (`{config.model.source}`, resolved by `tasks.models.sources.resolve_model_source`) and "
        "`PeftModel.from_pretrained(base, adapter_dir)`."
    )
    card = ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        title=f"{name}: LoRA adapter from grpoflow",
        summary=summary,
        data=data_text,
        recipe=recipe,
        tools=tools_text(config),
        probes=probes_text,
        evaluation=_table(evaluation),
        promotion=decision,
        samples=samples,
        loading=loading,
    )
    return str(card), summary


def _example_prompt(scores: Any) -> str:
    """A hold-out prompt in the form the adapter was trained on (its card's first sample), for the examples."""
    text = scores.samples[0]["prompt"] if scores.samples else "…"
    return text.removeprefix("user: ").replace("\\", "\\\\").replace('"', '\\"')


def short_description(card_summary: str, registered_model: str, version: str) -> str:
    """The version's description in the MLflow UI (Postgres stores limit it to 5,000 characters): the card's
    summary and where the whole card is."""
    text = (
        f"{card_summary}\n\nModel card: the version's `README.md` (models:/{registered_model}/{version}, beside "
        "MLmodel; also artifacts/adapter/README.md)."
    )
    return text[:5000]
