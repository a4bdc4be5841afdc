"""General ability before and after training: perplexity of a small general text corpus and accuracy on a
small general question set. Both ship with grpoflow (``tasks/data``) or come from the config.
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.data import render_prompt
from tasks.generation import generate_completions
from tasks.precision import compute_autocast

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_CORPUS = DATA_DIR / "general_text.txt"
DEFAULT_QUESTIONS = DATA_DIR / "general_qa.jsonl"


@dataclass
class GeneralAbility:
    perplexity: float
    qa_accuracy: float
    qa_questions: int
    corpus_tokens: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def perplexity(model: Any, tokenizer: Any, texts: list[str]) -> tuple[float, int]:
    """Token-weighted perplexity of ``texts`` (one forward pass each); returns (perplexity, tokens scored)."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
                if ids.shape[1] < 2:
                    continue
                loss = model(input_ids=ids, labels=ids).loss.float().item()
                total_nll += loss * (ids.shape[1] - 1)
                total_tokens += ids.shape[1] - 1
    finally:
        model.train(was_training)
    return math.exp(total_nll / max(total_tokens, 1)), total_tokens


def answer_matches(completion: str, answers: list[str]) -> bool:
    """Whether any accepted answer appears as whole words in the completion (case-insensitive).

    >>> answer_matches("The capital is Paris.", ["paris"]), answer_matches("Parisian", ["paris"])
    (True, False)
    """
    text = completion.lower()
    return any(re.search(rf"(?<!\w){re.escape(answer.lower())}(?!\w)", text) for answer in answers)


def load_questions(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def general_ability(
    model: Any,
    tokenizer: Any,
    corpus: Path = DEFAULT_CORPUS,
    questions: Path = DEFAULT_QUESTIONS,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    precision: str = "fp32",
) -> GeneralAbility:
    """Score one model's general ability (greedy answers, so the same model always gets the same numbers)."""
    texts = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    with compute_autocast(precision):
        ppl, tokens = perplexity(model, tokenizer, texts)
    items = load_questions(questions)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": item["question"]}]) for item in items]
    answers = generate_completions(
        model,
        tokenizer,
        prompts,
        greedy=True,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        precision=precision,
    )
    correct = sum(answer_matches(a[0], item["answers"]) for a, item in zip(answers, items, strict=True))
    return GeneralAbility(ppl, correct / len(items) if items else math.nan, len(items), tokens)


def forgetting(base: GeneralAbility, trained: GeneralAbility) -> dict[str, float]:
    """The drop from ``base`` to ``trained``: QA accuracy lost (points) and relative perplexity increase.

    >>> forgetting(GeneralAbility(10.0, 0.5, 40, 100), GeneralAbility(12.0, 0.4, 40, 100))
    {'qa_accuracy_drop': 0.09999999999999998, 'perplexity_increase': 0.19999999999999996}
    """
    return {
        "qa_accuracy_drop": base.qa_accuracy - trained.qa_accuracy,
        "perplexity_increase": trained.perplexity / base.perplexity - 1.0,
    }
