"""A reward model as a reward: a sequence-classification model scores each prompt and completion, in batches, in
the process that calls it (the trainer's). Wrapped as a grpoflow reward rather than handed to TRL as a bare model,
so its verdicts pass the None guard, the ledger, the canaries and ``rescore`` like every other reward's, and go
through the verdict cache (keyed by the model's files, so a changed model is asked again).
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reward_fns.judges.cache import VerdictCache, verdict_key
from reward_fns.judges.llm import JudgeStats
from reward_fns.judges.settings import RewardModelSettings
from reward_fns.text import completion_text, conversation_of, prompt_text


def model_digest(source: str) -> str:
    """A digest of a model folder's weights and config (names, sizes and the bytes of the small files), or the
    source itself when it is no folder (a Hub id: its name is what there is).

    >>> import tempfile; folder = Path(tempfile.mkdtemp()); _ = (folder / "config.json").write_text("{}")
    >>> model_digest(str(folder)) == model_digest(str(folder)), model_digest("org/model")
    (True, 'org/model')
    """
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return source
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(folder).as_posix()}:{size}".encode())
        if size < 2**20:
            digest.update(file.read_bytes())
        else:  # the first and last MiB of a weights file: a retrained model changes both
            with file.open("rb") as handle:
                digest.update(handle.read(1 << 20))
                handle.seek(-(1 << 20), 2)
                digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=2)
def load_reward_model(source: str, digest: str) -> tuple[Any, Any]:
    """The model and tokenizer behind ``source``, loaded once per process and content (``digest``): every stage
    builds its rewards afresh (validate's canaries, each probe, each evaluated model), and a reward model is no
    cheaper to load than the policy."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.truncation_side = "left"  # the completion's end is what is judged
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


class RewardModel:
    """The reward: ``reward(completions=..., prompts=...)`` → one score per completion (sigmoid of the model's
    logit by default). The model loads at the first call, once per process."""

    def __init__(self, settings: RewardModelSettings, cache: VerdictCache | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.stats = JudgeStats()
        self.identity = {
            "kind": "reward_model",
            "model": model_digest(settings.model),
            "max_length": settings.max_length,
            "normalize": settings.normalize,
            "label": settings.label,
        }
        self._loaded: tuple[Any, Any] | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the model is loaded again where the reward is unpickled
        return {"settings": self.settings, "cache": self.cache}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["cache"])

    def _model(self) -> tuple[Any, Any]:
        with self._lock:
            if self._loaded is None:
                self._loaded = load_reward_model(self.settings.model, self.identity["model"])
            return self._loaded

    def text(self, prompt: Any, completion: Any) -> str:
        """What the model reads: the whole conversation (``conversation_of``: its system prompt and earlier turns
        too, as the verdict's key has them) through its chat template when the tokenizer has one, else the prompt's
        text and the completion one after the other."""
        _, tokenizer = self._model()
        answer = completion_text(completion)
        if getattr(tokenizer, "chat_template", None):
            messages = conversation_of(prompt)
            return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
        return f"{prompt_text(prompt)}\n{answer}"

    def score(self, texts: list[str]) -> list[float]:
        """The model's scores of ``texts``, ``batch_size`` at a time."""
        import torch

        model, tokenizer = self._model()
        scores: list[float] = []
        for start in range(0, len(texts), self.settings.batch_size):
            batch = tokenizer(
                texts[start : start + self.settings.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.settings.max_length,
            )
            with torch.inference_mode():
                logits = model(**batch).logits.float()
            if logits.shape[-1] == 1:
                values = logits[:, 0].sigmoid() if self.settings.normalize == "sigmoid" else logits[:, 0]
            else:
                values = logits.softmax(-1)[:, self.settings.label]
            scores += [float(v) for v in values]
        return scores

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any] | None = None, **columns: Any):
        n = len(completions)
        prompts = list(prompts or [""] * n)
        keys = [
            verdict_key(self.identity, prompt_text(p), completion_text(c))
            for p, c in zip(prompts, completions, strict=True)
        ]
        verdicts: dict[str, float | None] = dict(self.cache.get_many(keys)) if self.cache else {}
        todo = list({key: i for i, key in enumerate(keys) if key not in verdicts}.values())
        self.stats.cached += n - len(todo)
        self.stats.asked += len(todo)
        if todo:
            fresh = dict(
                zip(
                    [keys[i] for i in todo],
                    self.score([self.text(prompts[i], completions[i]) for i in todo]),
                    strict=True,
                )
            )
            if self.cache is not None:
                self.cache.put_many(fresh)
            verdicts.update(fresh)
        return [verdicts.get(key) for key in keys]
