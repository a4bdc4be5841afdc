"""The settings of judged rewards, read from a reward's ``args`` in the config and checked at load.

``rewards: [{name: llm_judge, args: {url: ..., model: ...}}]`` — every key below, nothing else (a misspelled key is
an error that names it). Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The only environment variables a judge may read its key from: a config in a shared experiment cannot make a node
# send any other of its variables as a Bearer header.
JUDGE_KEY_VARIABLES = ("GRPOFLOW_JUDGE_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def redact_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced: what errors, logs and MLflow params show.

    >>> redact_credentials("HTTP 401 from https://ann:s3cret@judge.example/v1/chat/completions")
    'HTTP 401 from https://***@judge.example/v1/chat/completions'
    >>> redact_credentials("http://127.0.0.1:8001/v1")
    'http://127.0.0.1:8001/v1'
    """
    return _USERINFO.sub(r"\1***@", text)


def is_loopback(host: str) -> bool:
    """Whether only this host reaches ``host``.

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0"), is_loopback("10.0.0.5")
    (True, True, False, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` names this machine (a key sent there never crosses a network).

    >>> is_loopback_url("http://127.0.0.1:8001/v1"), is_loopback_url("http://localhost/v1")
    (True, True)
    >>> is_loopback_url("http://judge.internal:8001/v1")
    False
    """
    return is_loopback(urlsplit(url).hostname or "")


def read_key_file(path: str | os.PathLike[str], what: str) -> str:
    """The key a file holds (a mounted secret; surrounding whitespace dropped); ValueError naming ``what``."""
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"{what} {path} is empty")
    return key


DEFAULT_RUBRIC = (
    "Judge whether the response answers the task correctly, completely and concisely. A response that is wrong, "
    "off-task, padded, or that repeats these instructions scores low."
)

POINTWISE_TEMPLATE = """You grade a response to a task against a rubric.

Rubric: {rubric}

Task:
{prompt}
{reference_block}
Response:
{completion}

Give the response a score from 0 (worst) to {max_score} (best). Answer with the number only."""

PAIRWISE_TEMPLATE = """You compare two responses to a task against a rubric.

Rubric: {rubric}

Task:
{prompt}

Response A:
{first}

Response B:
{second}

Which response is better? Answer with the letter A or B only."""


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LLMJudgeSettings(_Settings):
    """An LLM judge over an OpenAI-compatible ``/chat/completions`` endpoint (vLLM's server, or any URL)."""

    url: str = Field(description="The endpoint's base URL, e.g. http://127.0.0.1:8001/v1.")
    model: str = Field(description="The served model's name.")
    model_digest: str | None = Field(
        None,
        description="The judge model's content digest (grpoflow vllm-serve --judge prints it): part of the verdict "
        "cache's key, so a changed judge behind the same name is asked again, and the same judge on another host "
        "shares its verdicts. Default: the model's name at its URL (never another endpoint's verdicts).",
    )
    mode: Literal["pointwise", "pairwise"] = Field(
        "pointwise",
        description="pointwise: a 0..max_score score; pairwise: against a reference completion, both orders "
        "(1 both won, 0.5 split, 0 both lost).",
    )
    rubric: str = DEFAULT_RUBRIC
    template: str | None = Field(
        None,
        description="The judge's prompt; placeholders {rubric} {prompt} {completion} {reference_block} {max_score} "
        "(pairwise: {rubric} {prompt} {first} {second}). Default: grpoflow's.",
    )
    reference_column: str | None = Field(
        "ground_truth", description="The data column shown as the reference answer (pointwise), where rows have it."
    )
    reference_completion_column: str = Field(
        "reference_completion", description="pairwise: the column holding the completion to compare against."
    )
    score: Literal["choice", "expected"] = Field(
        "choice",
        description="choice: the judge's answer is the verdict; expected: the probability-weighted mean of the "
        "scores (or A/B) in its first token's top log-probabilities (G-Eval), which ranks answers even where a weak "
        "judge's most likely answer is the same for all (needs logprobs at the endpoint and max_score <= 9).",
    )
    max_score: int = Field(10, ge=1, le=100)
    temperature: float = Field(0.0, ge=0.0)
    max_tokens: int = Field(8, ge=1)
    structured_outputs: bool = Field(
        True,
        description="Constrain the answer to the allowed scores or letters with vLLM's structured_outputs (vLLM "
        "0.31 ignores the old guided_* fields); off for endpoints that refuse unknown fields.",
    )
    seed_requests: bool = Field(
        True,
        description="Send each request a seed drawn from its verdict's key, so a sampling vLLM server answers the "
        "same item the same way; off for vLLM's CPU build, whose engine dies on a per-request seed "
        "(grpoflow vllm-serve --judge prints it off there). Either way the verdict cache keeps a rerun's verdicts.",
    )
    api_key_env: str | None = Field(
        None,
        description="The environment variable holding the API key (never the key): one of GRPOFLOW_JUDGE_API_KEY, "
        "VLLM_API_KEY, OPENAI_API_KEY. Where it is unset, the file its <NAME>_FILE variable names is read.",
    )
    api_key_file: str | None = Field(
        None, description="A file holding the API key (a mounted secret), instead of api_key_env."
    )
    allow_key_over_http: bool = Field(
        False,
        description="Send the key over plain http to a host other than this one (refused by default: anyone on the "
        "path reads it); warns at every load.",
    )
    max_concurrency: int = Field(8, ge=1, description="Requests in flight at once.")
    max_retries: int = Field(3, ge=0, description="Retries of a request that failed to connect or got 429/5xx.")
    backoff_s: float = Field(0.5, ge=0.0, description="The first retry's wait; doubled for each next one.")
    request_timeout_s: float = Field(30.0, gt=0)
    deadline_s: float = Field(
        300.0, gt=0, description="A batch's verdicts not in by then are None (counted by grpo.max_none_share)."
    )

    @field_validator("api_key_env")
    @classmethod
    def _allowed_key_variable(cls, name: str | None) -> str | None:
        if name is not None and name not in JUDGE_KEY_VARIABLES:
            raise ValueError(f"api_key_env {name!r} is not one of {', '.join(JUDGE_KEY_VARIABLES)}")
        return name

    @model_validator(mode="after")
    def _key_where_it_belongs(self) -> LLMJudgeSettings:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give the judge's key one way: api_key_env or api_key_file, not both")
        keyed = self.api_key_env or self.api_key_file
        plain = urlsplit(self.url).scheme == "http" and not is_loopback_url(self.url)
        if keyed and plain and not self.allow_key_over_http:
            raise ValueError(
                f"the judge's API key would travel over plain http to {urlsplit(self.url).hostname}: use https, "
                "or set allow_key_over_http: true on a network you trust"
            )
        if keyed and plain:
            import logging

            logging.getLogger(__name__).warning(
                "the judge's API key travels over plain http to %s (allow_key_over_http)", urlsplit(self.url).hostname
            )
        return self

    def api_key(self) -> str | None:
        """The key sent as ``Authorization: Bearer``: from ``api_key_file``, else ``api_key_env``'s variable, else
        the file its ``<NAME>_FILE`` variable names (what ``grpoflow vllm-serve --api-key-file`` sets); None when
        no key is configured. ValueError naming the file or variable that holds none."""
        if self.api_key_file:
            return read_key_file(self.api_key_file, "the judge's api_key_file")
        if not self.api_key_env:
            return None
        if os.environ.get(self.api_key_env):
            return os.environ[self.api_key_env]
        if os.environ.get(f"{self.api_key_env}_FILE"):
            return read_key_file(os.environ[f"{self.api_key_env}_FILE"], f"{self.api_key_env}_FILE")
        raise ValueError(f"the judge's key variable {self.api_key_env} (or {self.api_key_env}_FILE) is not set")

    @model_validator(mode="after")
    def _one_token_scores(self) -> LLMJudgeSettings:
        if self.score == "expected" and self.max_score > 9:
            raise ValueError("score expected reads one token: max_score must be 9 or less (10 is two tokens)")
        return self

    @model_validator(mode="after")
    def _template_fits(self) -> LLMJudgeSettings:
        if self.template is not None:
            needed = ("{first}", "{second}") if self.mode == "pairwise" else ("{completion}",)
            missing = [name for name in needed if name not in self.template]
            if missing:
                raise ValueError(f"the {self.mode} judge's template needs {', '.join(missing)}")
        return self

    def identity(self) -> dict[str, object]:
        """What decides a verdict besides its prompt and completion: the verdict cache's key. With a digest the
        URL is left out (the same judge on another host gives the same verdicts); without one the name alone
        could be any model, so the endpoint is part of it."""
        return {
            "kind": "llm_judge",
            "model": self.model_digest or f"{self.model}@{redact_credentials(self.url).rstrip('/')}",
            "mode": self.mode,
            "template": self.template or (PAIRWISE_TEMPLATE if self.mode == "pairwise" else POINTWISE_TEMPLATE),
            "rubric": self.rubric,
            "max_score": self.max_score,
            "score": self.score,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "structured_outputs": self.structured_outputs,
            "seed_requests": self.seed_requests,
        }


class RewardModelSettings(_Settings):
    """A sequence-classification reward model, scored in the trainer's process."""

    model: str = Field(
        description="A folder holding the model and its tokenizer (a Hub id where the Hub is reachable)."
    )
    batch_size: int = Field(16, ge=1)
    max_length: int = Field(1024, ge=8, description="Prompt and completion are cut to this many tokens (left side).")
    normalize: Literal["sigmoid", "none"] = Field(
        "sigmoid", description="sigmoid: the score as a probability in (0, 1); none: the raw logit."
    )
    label: int = Field(
        1, ge=0, description="With two or more labels, the index whose probability is the reward (softmax)."
    )
