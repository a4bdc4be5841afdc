"""General ability of a model, measured for the forgetting check: per-question correctness on a general
multiple-choice set (scored by answer likelihood: no generation), per-document log-likelihood of a general
text, and — against the base model — the per-token KL(base ‖ model) over that text, from the base's top-k
log-probabilities computed once and cached. The base's and a registered version's results are cached by model
and set fingerprint. The sets ship with grpoflow (``tasks/evaluation/general_sets``, built by
``tasks/evaluation/build_general_sets.py``)
or come from the config (``evaluation.general_corpus``/``general_questions``). Statistics:
``tasks/evaluation/statistics.py``.
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.config import EvaluationSettings
from tasks.evaluation.cache import fingerprint
from tasks.evaluation.statistics import overlapping_questions
from tasks.inputs import prompt_text, read_jsonl, render_prompt
from tasks.models import compute_autocast, generate_completions
from tasks.speedups.packing import packed_for_inference

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "general_sets"
DEFAULT_CORPUS = DATA_DIR / "general_text.txt"
DEFAULT_QUESTIONS = DATA_DIR / "general_qa.jsonl"
TOP_K = 64  # base log-probabilities kept per token for the KL (the rest as one tail bucket)


@dataclass
class GeneralAbility:
    """One model's general ability; the per-item lists feed the paired statistics (None in results made before
    they existed)."""

    perplexity: float
    qa_accuracy: float
    qa_questions: int
    corpus_tokens: int
    qa_correct: list[int] | None = None
    qa_ids: list[str] | None = None
    qa_categories: list[str] | None = None
    doc_nll: list[float] | None = None
    doc_tokens: list[int] | None = None
    doc_kl: list[float] | None = None  # summed KL(base ‖ this model) per document; None for the base itself

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        if self.doc_kl:
            data["kl"] = sum(self.doc_kl) / max(self.corpus_tokens, 1)
        return data


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


def load_corpus(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _batches(items: list[Any], size: int) -> Any:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _forward(model: Any, sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    """Log-probabilities of every next token of a right-padded batch (rows past a sequence's end are padding)."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1)


def choice_logprobs(
    model: Any,
    contexts: list[list[int]],
    choices: list[list[list[int]]],
    pad_id: int,
    batch_size: int,
    report: Callable[[int], None] | None = None,
) -> list[list[float]]:
    """Summed log-probability of each choice after its context. Each context runs once (``shared_prefill``, as
    sampling does): its last position scores every choice's first token, and only the choices of more than one
    token go on, their context's cache rows copied to them, so a question with four choices costs little more
    than one; questions are batched by their number of choices."""
    from tasks.models import shared_prefill, with_cache

    device = next(model.parameters()).device
    results: list[list[float]] = [[] for _ in contexts]
    by_count: dict[int, list[int]] = {}
    for index, options in enumerate(choices):
        by_count.setdefault(len(options), []).append(index)
    for count, indices in by_count.items():
        for batch in _batches(sorted(indices, key=lambda i: len(contexts[i])), max(1, batch_size // count)):
            width = max(len(contexts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                ids[row, width - len(contexts[index]) :] = torch.tensor(contexts[index])
                mask[row, width - len(contexts[index]) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            cache, first = shared_prefill(model, ids, mask, 1)  # one row per question
            first = torch.log_softmax(first.float(), dim=-1)
            options = [(row, choice) for row in range(len(batch)) for choice in choices[batch[row]]]
            longer = [n for n, (_, option) in enumerate(options) if len(option) > 1]  # the ones that go on
            rest: dict[int, torch.Tensor] = {}
            if longer:
                rows = torch.tensor([options[n][0] for n in longer], device=device)
                cache.batch_select_indices(rows)  # each continuing choice gets its question's cache row
                follow = torch.full(
                    (len(longer), max(len(options[n][1]) for n in longer) - 1), pad_id, dtype=torch.long, device=device
                )
                follow_mask = torch.zeros_like(follow)
                for slot, n in enumerate(longer):
                    option = options[n][1]
                    follow[slot, : len(option) - 1] = torch.tensor(option[:-1], device=device)
                    follow_mask[slot, : len(option) - 1] = 1
                attention = torch.cat([mask[rows], follow_mask], dim=1)
                positions = mask.sum(dim=-1, keepdim=True)[rows] + torch.arange(follow.shape[1], device=device)[None, :]
                logits = model(
                    input_ids=follow,
                    attention_mask=attention,
                    position_ids=positions,
                    use_cache=True,
                    **with_cache(cache),
                ).logits
                rest = dict(zip(longer, torch.log_softmax(logits.float(), dim=-1), strict=True))
            for n, (row, option) in enumerate(options):
                total = float(first[row, option[0]])
                for k in range(1, len(option)):
                    total += float(rest[n][k - 1, option[k]])
                results[batch[row]].append(total)
            if report:
                report(len(batch))
    return results


def qa_by_likelihood(
    model: Any,
    tokenizer: Any,
    items: list[dict[str, Any]],
    batch_size: int,
    report: Callable[[int], None] | None = None,
) -> list[int]:
    """1 per question whose likeliest choice is an accepted answer, else 0: each choice scored by its
    log-likelihood per character after ``Question: …\\nAnswer:`` (plain text, as likelihood evaluations do: no
    chat template, whose system prompt would triple the tokens)."""
    contexts = [
        tokenizer(f"Question: {item['question']}\nAnswer:", add_special_tokens=False)["input_ids"] for item in items
    ]
    options = [
        [tokenizer(f" {choice}", add_special_tokens=False)["input_ids"] for choice in item["choices"]] for item in items
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores = choice_logprobs(model, contexts, options, pad, batch_size, report)
    correct = []
    for item, item_scores in zip(items, scores, strict=True):
        normalized = [
            score / max(len(str(choice)), 1) for score, choice in zip(item_scores, item["choices"], strict=True)
        ]
        best = str(item["choices"][max(range(len(normalized)), key=normalized.__getitem__)])
        correct.append(int(best.lower() in {a.lower() for a in item["answers"]}))
    return correct


def qa_by_generation(
    model: Any, tokenizer: Any, items: list[dict[str, Any]], batch_size: int, precision: str, stock: bool = False
) -> list[int]:
    """For question sets without choices (``{question, answers}``): greedy answers matched by whole words."""
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": item["question"]}]) for item in items]
    answers = generate_completions(
        model,
        tokenizer,
        prompts,
        greedy=True,
        max_new_tokens=16,
        batch_size=batch_size,
        precision=precision,
        stock=stock,
    )
    return [int(answer_matches(a[0], item["answers"])) for a, item in zip(answers, items, strict=True)]


@dataclass
class TopK:
    """The base model's top-k next-token log-probabilities over the corpus, per document ([T, k] each)."""

    indices: list[torch.Tensor]
    logprobs: list[torch.Tensor]


def corpus_scores(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    batch_size: int,
    reference: TopK | None = None,
    keep_top_k: bool = False,
    report: Callable[[int], None] | None = None,
) -> tuple[list[float], list[int], list[float] | None, TopK | None]:
    """Per document: summed negative log-likelihood and tokens scored; with ``reference`` (the base's top-k),
    the summed per-token KL(base ‖ model) (the base's mass outside its top k as one bucket); with
    ``keep_top_k``, this model's own top-k, to be a reference."""
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    batch_size = max(1, min(batch_size, 16))  # full-vocabulary log-probabilities at every position: small batches
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    nll, tokens, kls = [], [], []
    kept = TopK([], [])
    for start, batch in zip(range(0, len(encoded), batch_size), _batches(encoded, batch_size), strict=True):
        logprobs = _forward(model, batch, pad)
        for row, ids in enumerate(batch):
            length = len(ids) - 1
            if length < 1:
                nll.append(0.0), tokens.append(0), kls.append(0.0)
                continue
            rows = logprobs[row, :length]
            targets = torch.tensor(ids[1:], device=rows.device)
            nll.append(float(-rows.gather(1, targets[:, None]).sum()))
            tokens.append(length)
            if keep_top_k:
                top = rows.topk(min(TOP_K, rows.shape[-1]), dim=-1)
                kept.indices.append(top.indices.cpu()), kept.logprobs.append(top.values.cpu())
            if reference is not None:
                base_idx = reference.indices[start + row].to(rows.device)
                base_lp = reference.logprobs[start + row].to(rows.device)
                here = rows.gather(1, base_idx)
                base_p, here_p = base_lp.exp(), here.exp()
                tail_base = (1 - base_p.sum(-1)).clamp_min(1e-12)
                tail_here = (1 - here_p.sum(-1)).clamp_min(1e-12)
                kl = (base_p * (base_lp - here)).sum(-1) + tail_base * (tail_base.log() - tail_here.log())
                kls.append(float(kl.clamp_min(0).sum()))
        if report:
            report(len(batch))
    return nll, tokens, (kls if reference is not None else None), (kept if keep_top_k else None)


def _cache_dir() -> Path:
    from tasks.models import cache_dir

    return cache_dir() / "general-ability"


_REFERENCES: dict[str, TopK] = {}


def _reference(key: str) -> TopK | None:
    """The base model's top-k under ``key``: kept in this process, else read from the cache (the evaluation's
    other process scored the base)."""
    if key not in _REFERENCES:
        stored = _cache_dir() / f"{key}.pt"
        if stored.is_file():
            _REFERENCES[key] = TopK(**torch.load(stored))
    return _REFERENCES.get(key)


def general_ability(
    model: Any,
    tokenizer: Any,
    corpus: Path = DEFAULT_CORPUS,
    questions: Path = DEFAULT_QUESTIONS,
    batch_size: int = 64,
    precision: str = "fp32",
    model_key: str | None = None,
    base_key: str | None = None,
    stock: bool = False,
    report: Callable[[int], None] | None = None,
) -> GeneralAbility:
    """One model's general ability. ``model_key``: a fingerprint of the model (base folder + adapter) under which
    the result is cached (the base and registered versions; None: not cached). ``base_key``: the base model's
    key, whose top-k log-probabilities give the KL (None for the base itself; read from the cache when another
    process scored the base). ``stock``: no packed layers. ``report(n)``: n more passages or questions scored."""
    sets = fingerprint(corpus, questions, extra=f"{precision}:{TOP_K}:v2")
    key = f"{model_key}-{sets}" if model_key else None
    cached = _cache_dir() / f"{key}.json" if key else None
    if cached is not None and cached.is_file():
        ability = GeneralAbility(**json.loads(cached.read_text()))
        if base_key is not None:
            return ability
        if key not in _REFERENCES and cached.with_suffix(".pt").is_file():
            _REFERENCES[key] = TopK(**torch.load(cached.with_suffix(".pt")))
        if key in _REFERENCES:
            return ability
    reference = _reference(f"{base_key}-{sets}") if base_key else None
    if base_key and reference is None:
        logger.warning("no base log-probabilities for the KL (the base model is scored first); KL not measured")
    texts, items = load_corpus(corpus), load_questions(questions)
    was_training = model.training
    model.eval()
    try:
        # Packed layers for the policies evaluation loads (adapters merged); an unmerged PEFT model as it is.
        unpacked = stock or hasattr(model, "peft_config")
        packed = nullcontext() if unpacked else packed_for_inference(model, precision)
        with torch.inference_mode(), compute_autocast(precision), packed:
            nll, tokens, kls, top = corpus_scores(
                model, tokenizer, texts, batch_size, reference, base_key is None, report
            )
            if items and all("choices" in item for item in items):
                correct = qa_by_likelihood(model, tokenizer, items, batch_size, report)
            else:
                correct = qa_by_generation(model, tokenizer, items, batch_size, precision, stock)
    finally:
        model.train(was_training)
    ability = GeneralAbility(
        perplexity=math.exp(sum(nll) / max(sum(tokens), 1)),
        qa_accuracy=sum(correct) / len(correct) if correct else math.nan,
        qa_questions=len(correct),
        corpus_tokens=sum(tokens),
        qa_correct=correct,
        qa_ids=[str(item.get("id", i)) for i, item in enumerate(items)],
        qa_categories=[str(item.get("category", "general")) for item in items],
        doc_nll=nll,
        doc_tokens=tokens,
        doc_kl=kls,
    )
    if cached is not None:
        from tasks.layout import write_atomically

        cached.parent.mkdir(parents=True, exist_ok=True)
        if top is not None:
            _REFERENCES[key] = top
            # A staging file of this writer's own: two jobs (this process and its forked worker) may cache the same
            # reference at once, and a shared staging name let one rename the other's file away.
            staging = cached.with_suffix(f".pt.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
            torch.save(asdict(top), staging)
            staging.replace(cached.with_suffix(".pt"))
        write_atomically(cached, json.dumps(asdict(ability)))
    return ability


def general_questions_trained_on(settings: EvaluationSettings, holdout_path: Path) -> set[str]:
    """Ids of the general questions that occur in the training split (``train.jsonl`` beside the hold-out
    file): the forgetting statistics leave them out, and the log says how many."""
    train_path = holdout_path.with_name("train.jsonl")
    if not settings.forgetting or not train_path.is_file():
        return set()
    items = load_questions(settings.general_questions or DEFAULT_QUESTIONS)
    ids = [str(item.get("id", index)) for index, item in enumerate(items)]
    prompts = [prompt_text(row["prompt"]) for row in read_jsonl(train_path)]
    overlap = overlapping_questions(ids, [item["question"] for item in items], prompts)
    if overlap:
        logger.warning("%d general questions occur in the training data; left out of forgetting", len(overlap))
    return overlap
