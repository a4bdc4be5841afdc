"""The one-GPU GSM8K recipe (configs/gsm8k-qwen2.5-0.5b.yaml) rehearsed on this CPU through vLLM: the config as
shipped, with only the model, the data, and sizes a CPU can run overridden (the test checks that list), so every
part a GPU user's first run takes is live: worked-solution SFT, the official-test-split evaluation with its leak
check, GSM8K's strict and flexible extraction, the card."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "gsm8k-qwen2.5-0.5b.yaml"
# What the rehearsal may change, and why: the model and data (no Hub here), sizes (steps, batches, lengths, prompt
# counts: a CPU's minutes), precision (vLLM's CPU build and the trainer agree in fp32), the probe gate's threshold
# (a random model finds no signal to gate on) and the forgetting check (its general sets on a random model).
ALLOWED = {
    "output_dir",
    "model.source",
    "model.precision",
    "data.source",
    "data.test_source",
    "data.max_prompt_chars",
    "sft.max_steps",
    "sft.batch_size",
    "grpo.max_steps",
    "grpo.batch_size",
    "grpo.num_generations",
    "grpo.max_completion_length",
    "grpo.generation.vllm_max_model_len",
    "probe.num_prompts",
    "probe.batch_size",
    "probe.min_signal_share",
    "evaluation.num_prompts",
    "evaluation.n_samples",
    "evaluation.k",
    "evaluation.max_new_tokens",
    "evaluation.batch_size",
    "evaluation.forgetting",
    "evaluation.bootstrap_resamples",
    "tracking.registered_model_name",
}


def _flat(raw: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _gsm8k_rows(first: int, count: int) -> list[dict[str, str]]:
    """GSM8K's shape: a question, and an answer with the worked solution, calculator annotations and '#### N'."""
    return [
        {
            "question": f"Tom has {i} bags of {i + 2} apples. How many apples does he have?",
            "answer": f"He has {i} * {i + 2} = <<{i}*{i + 2}={i * (i + 2)}>>{i * (i + 2)} apples.\n#### {i * (i + 2)}",
        }
        for i in range(first, first + count)
    ]


def test_the_gsm8k_recipe_runs_as_shipped_on_the_cpu_through_vllm(tmp_path: Path, vllm_model_dir: Path) -> None:
    from flows.pipeline import pipeline
    from tasks.inputs import read_jsonl
    from tasks.models import TINY_RANDOM_VLLM
    from tasks.models.sources import resolve_model_source

    train, test = _gsm8k_rows(1, 60), _gsm8k_rows(100, 6) + _gsm8k_rows(5, 1)  # the last test row is a training row
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test))
    overrides = {
        "output_dir": str(tmp_path / "out"),
        "model.source": str(resolve_model_source(TINY_RANDOM_VLLM)),
        "model.precision": "fp32",
        "data.source": str(tmp_path / "train.jsonl"),
        "data.test_source": str(tmp_path / "test.jsonl"),
        "sft.max_steps": 2,
        "sft.batch_size": 4,
        "grpo.max_steps": 2,
        "grpo.batch_size": 4,
        "grpo.num_generations": 4,
        "grpo.max_completion_length": 16,
        "grpo.generation.vllm_max_model_len": 512,
        "probe.num_prompts": 4,
        "probe.batch_size": 16,
        "probe.min_signal_share": 0.0,
        "evaluation.num_prompts": 6,
        "evaluation.n_samples": 2,
        "evaluation.k": [1, 2],
        "evaluation.max_new_tokens": 16,
        "evaluation.batch_size": 16,
        "evaluation.forgetting": False,
        "evaluation.bootstrap_resamples": 200,
        "tracking.registered_model_name": "gsm8k-rehearsal",
    }
    assert set(overrides) <= ALLOWED
    config = load_config(RECIPE, overrides)
    shipped = _flat(load_config(RECIPE).model_dump(mode="json"))
    changed = {key for key, value in _flat(config.model_dump(mode="json")).items() if shipped.get(key) != value}
    assert changed <= ALLOWED, f"the rehearsal changed more than it may: {sorted(changed - ALLOWED)}"
    assert config.grpo.generation.backend == "vllm" and config.data.worked_solution == "answer"

    summary = pipeline(config, "rehearsal")
    run = Path(summary["run_dir"])
    # Worked-solution SFT: the rows carry the solution, which SFT's examples turn into reasoning + \boxed{N}.
    validated = read_jsonl(run / "validate" / "train.jsonl")
    assert all("<<" in row["worked_solution"] for row in validated)
    from tasks.models import load_tokenizer
    from tasks.sft import sft_examples

    rows = validated[:3]
    examples = sft_examples(rows, load_tokenizer(vllm_model_dir), config)
    for example, row in zip(examples, rows, strict=True):
        assert example["completion"].endswith(f"\\boxed{{{row['ground_truth']}}}"), example
    assert not any("<<" in e["completion"] or "####" in e["completion"] for e in examples)
    # The test source: its rows are what evaluation scored; the leaked training row was quarantined.
    report = json.loads((run / "validate" / "report.json").read_text())
    assert report["test"]["rows_kept"] == 7 and report["test"]["leaks"] == 1
    evaluation = summary["evaluation"]
    assert evaluation["engine"] == "vllm-colocate"
    grpo = evaluation["models"]["grpo"]
    assert grpo["n_prompts"] == 6 and set(grpo["extractions"]) == {"gsm8k_strict", "gsm8k_flexible"}
    card = (run / "promote" / "candidate-model" / "README.md").read_text()
    assert "gsm8k_strict greedy" in card and "gsm8k_flexible pass@1" in card
    assert f"evaluated on the test source `{tmp_path / 'test.jsonl'} (test)`" in card
