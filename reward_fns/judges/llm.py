"""An LLM judge as a reward: an OpenAI-compatible ``/chat/completions`` endpoint scores each completion.

Pointwise, the judge reads the task, the reference answer (where the data has one) and the completion under a
rubric and answers a score from 0 to ``max_score`` (reward = score / max_score). Pairwise, it compares the
completion with a reference completion in both orders (reward 1 if it wins both, 0.5 if the orders disagree, 0 if
it loses both): a judge that prefers a position shows as split verdicts. The answer's form is fixed with vLLM's
``structured_outputs`` (a choice of the allowed scores or letters). Requests run concurrently under a bound, retry
with backoff on a failed connection or 429/5xx, and stop at a deadline; a verdict that does not arrive or cannot be
read is ``None``, which the pipeline counts (``grpo.max_none_share``). Every verdict goes through the verdict cache
when one is handed in; each request carries a seed drawn from the verdict's key, so a sampling server answers the
same item the same way.
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reward_fns.judges.cache import VerdictCache, verdict_key
from reward_fns.judges.settings import PAIRWISE_TEMPLATE, POINTWISE_TEMPLATE, LLMJudgeSettings, redact_credentials
from reward_fns.text import completion_text, prompt_text

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class _Retryable(Exception):
    """A response worth asking again for (429, 5xx)."""


@dataclass
class JudgeStats:
    """Counts across calls: ``requests`` made (retries included), verdicts ``asked`` of the judge and read from the
    cache (``cached``), ``none`` verdicts, pairwise ``split`` verdicts (the two orders disagreed)."""

    requests: int = 0
    asked: int = 0
    cached: int = 0
    none: int = 0
    split: int = 0
    last_error: str | None = None


def parse_score(text: str | None, max_score: int) -> float | None:
    """A pointwise answer as a reward in [0, 1]: its first number over ``max_score``; None when there is no number
    or it lies outside 0..max_score.

    >>> parse_score("7", 10), parse_score(" Score: 10/10", 10), parse_score("eleven", 10), parse_score("12", 10)
    (0.7, 1.0, None, None)
    """
    match = _NUMBER.search(text or "")
    if match is None:
        return None
    value = float(match[0])
    return value / max_score if 0 <= value <= max_score else None


def expected_score(top_logprobs: dict[str, float] | None, max_score: int) -> float | None:
    """A pointwise verdict as the judge's expected score (G-Eval's weighting): the probability-weighted mean of the
    score tokens among the first token's top log-probabilities, over ``max_score``; None when none is a score.
    A weak judge whose most likely answer is the same for everything still ranks answers this way.

    >>> import math; expected_score({"1": math.log(0.5), "3": math.log(0.5), "x": 0.0}, 4)
    0.5
    """
    weights = {int(t.strip()): math.exp(lp) for t, lp in (top_logprobs or {}).items() if t.strip().isdigit()}
    weights = {score: w for score, w in weights.items() if 0 <= score <= max_score}
    total = sum(weights.values())
    return sum(score * w for score, w in weights.items()) / total / max_score if total > 0 else None


def expected_choice(top_logprobs: dict[str, float] | None) -> float | None:
    """A pairwise answer as the probability of A among A and B; None when neither is there.

    >>> import math; round(expected_choice({"A": math.log(0.3), "B": math.log(0.1)}), 3)
    0.75
    """
    weights = {t.strip().upper(): math.exp(lp) for t, lp in (top_logprobs or {}).items()}
    a, b = weights.get("A", 0.0), weights.get("B", 0.0)
    return a / (a + b) if a + b > 0 else None


def parse_choice(text: str | None) -> str | None:
    """A pairwise answer's letter, A or B; None for anything else.

    >>> parse_choice(" B"), parse_choice("A."), parse_choice("Response B"), parse_choice("both")
    ('B', 'A', None, None)
    """
    letter = (text or "").strip().rstrip(".").strip().upper()
    return letter if letter in ("A", "B") else None


def fill(template: str, **values: str) -> str:
    """``template`` with its ``{name}`` placeholders replaced; other braces (JSON in a rubric) are left alone.

    >>> fill('Score {completion} as {"score": n}', completion="4")
    'Score 4 as {"score": n}'
    """
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    return template


class LLMJudge:
    """The reward: ``await judge(completions=..., prompts=..., **columns)`` → one verdict per completion."""

    def __init__(self, settings: LLMJudgeSettings, cache: VerdictCache | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.stats = JudgeStats()
        self.identity = settings.identity()
        self._api_key = settings.api_key()  # read once, where the judge is built: a missing key fails before training

    # -- the items ----------------------------------------------------------------------------------------------
    def _references(self, columns: dict[str, Any], n: int) -> list[Any]:
        name = (
            self.settings.reference_completion_column
            if self.settings.mode == "pairwise"
            else self.settings.reference_column
        )
        values = columns.get(name) if name else None
        if self.settings.mode == "pairwise" and values is None:
            raise ValueError(f"the pairwise judge needs the data column {name!r} (the completion to compare with)")
        return list(values) if values is not None else [None] * n

    def _messages(self, prompt: str, completion: str, reference: Any, order: int) -> list[dict[str, str]]:
        settings = self.settings
        if settings.mode == "pairwise":
            first, second = (completion, str(reference)) if order == 0 else (str(reference), completion)
            text = fill(
                settings.template or PAIRWISE_TEMPLATE,
                rubric=settings.rubric,
                prompt=prompt,
                first=first,
                second=second,
            )
        else:
            block = f"\nReference answer:\n{reference}\n" if reference not in (None, "") else ""
            text = fill(
                settings.template or POINTWISE_TEMPLATE,
                rubric=settings.rubric,
                prompt=prompt,
                completion=completion,
                reference=str(reference or ""),
                reference_block=block,
                max_score=str(settings.max_score),
            )
        return [{"role": "user", "content": text}]

    def _payload(self, messages: list[dict[str, str]], seed: int) -> dict[str, Any]:
        settings = self.settings
        payload: dict[str, Any] = {
            "model": settings.model,
            "messages": messages,
            "temperature": settings.temperature,
            "max_tokens": settings.max_tokens,
        }
        if settings.seed_requests:
            payload["seed"] = seed
        if settings.score == "expected":  # the first token's distribution is the verdict
            payload.update(max_tokens=1, logprobs=True, top_logprobs=20)
        if settings.structured_outputs:
            choices = ["A", "B"] if settings.mode == "pairwise" else [str(s) for s in range(settings.max_score + 1)]
            payload["structured_outputs"] = {"choice": choices}
        return payload

    # -- the requests -------------------------------------------------------------------------------------------
    async def _ask(self, client: Any, bound: asyncio.Semaphore, payload: dict[str, Any]) -> Any:
        """The judge's answer: its text, or with ``score: expected`` the first token's top log-probabilities;
        None after the retries (the reason kept in ``stats.last_error``). A request holds one of the
        ``max_concurrency`` slots; a backoff does not."""
        import httpx

        url = self.settings.url.rstrip("/") + "/chat/completions"
        shown = redact_credentials(url)  # what errors and logs say: never a password in a URL
        for attempt in range(self.settings.max_retries + 1):
            self.stats.requests += 1
            try:
                async with bound:
                    response = await client.post(url, json=payload)
                if response.status_code == 429 or response.status_code >= 500:
                    raise _Retryable(f"HTTP {response.status_code} from {shown}")
                if response.status_code >= 400:
                    self.stats.last_error = f"HTTP {response.status_code} from {shown}: {response.text[:200]}"
                    return None
                choice = response.json()["choices"][0]
                if self.settings.score == "expected":
                    return {t["token"]: float(t["logprob"]) for t in choice["logprobs"]["content"][0]["top_logprobs"]}
                content = choice["message"]["content"]
                return content if isinstance(content, str) else None
            except (httpx.TransportError, _Retryable) as exc:
                said = redact_credentials(str(exc))
                self.stats.last_error = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
                if attempt < self.settings.max_retries:
                    await asyncio.sleep(self.settings.backoff_s * 2**attempt)
            except (ValueError, KeyError, IndexError, TypeError) as exc:  # not an OpenAI-shaped answer
                self.stats.last_error = f"unreadable answer from {shown}: {exc}"
                return None
        return None

    async def _verdict(
        self, client: Any, bound: asyncio.Semaphore, messages: list[list[dict[str, str]]], seed: int
    ) -> float | None:
        answers = [
            await self._ask(client, bound, self._payload(turn, seed + order)) for order, turn in enumerate(messages)
        ]
        if self.settings.score == "expected":
            if self.settings.mode == "pointwise":
                return expected_score(answers[0], self.settings.max_score)
            first, second = (expected_choice(a) for a in answers)
            if first is None or second is None:
                return None
            score = (first + (1 - second)) / 2  # P(the completion wins) in each order
            self.stats.split += abs(first - (1 - second)) >= 0.5
            return score
        if self.settings.mode == "pointwise":
            return parse_score(answers[0], self.settings.max_score)
        wins = [parse_choice(answers[0]), parse_choice(answers[1])]
        if None in wins:
            return None
        score = ((wins[0] == "A") + (wins[1] == "B")) / 2
        self.stats.split += score == 0.5
        return score

    async def __call__(self, completions: Sequence[Any], prompts: Sequence[Any] | None = None, **columns: Any):
        """One verdict per completion (None where none arrived in time or it could not be read)."""
        import httpx

        n = len(completions)
        prompt_texts = [prompt_text(p) for p in (prompts or [""] * n)]  # what it reads and keys by: the same text
        texts = [completion_text(c) for c in completions]
        references = self._references(columns, n)
        keys = [verdict_key(self.identity, p, t, r) for p, t, r in zip(prompt_texts, texts, references, strict=True)]
        verdicts: dict[str, float | None] = dict(self.cache.get_many(keys)) if self.cache else {}
        todo = [i for i, key in enumerate(keys) if key not in verdicts]
        todo = list({keys[i]: i for i in todo}.values())  # one request per distinct item
        self.stats.cached += n - len(todo)
        self.stats.asked += len(todo)
        if todo:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            bound = asyncio.Semaphore(self.settings.max_concurrency)
            async with httpx.AsyncClient(timeout=self.settings.request_timeout_s, headers=headers) as client:
                tasks = {}
                for i in todo:
                    orders = 2 if self.settings.mode == "pairwise" else 1
                    turns = [self._messages(prompt_texts[i], texts[i], references[i], o) for o in range(orders)]
                    seed = int(keys[i][:8], 16)
                    tasks[keys[i]] = asyncio.ensure_future(self._verdict(client, bound, turns, seed))
                done, pending = await asyncio.wait(tasks.values(), timeout=self.settings.deadline_s)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
                    self.stats.last_error = (
                        f"{len(pending)} verdicts not in by the deadline of {self.settings.deadline_s:g} s"
                    )
            fresh = {
                key: (task.result() if task in done and not task.exception() else None) for key, task in tasks.items()
            }
            if self.cache is not None:
                self.cache.put_many(fresh)
            verdicts.update(fresh)
        result = [verdicts.get(key) for key in keys]
        self.stats.none += sum(v is None for v in result)
        if any(v is None for v in result) and self.stats.last_error:
            logger.warning(
                "judge %s: %d of %d verdicts None (%s)",
                self.settings.model,
                sum(v is None for v in result),
                n,
                self.stats.last_error,
            )
        return result
