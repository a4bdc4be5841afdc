"""Recording a version's smoke answers at registration: the first hold-out prompts, as a client would send them,
answered greedily by the transformers serving engine at the run's precision on one thread (as ``grpoflow serve``
checks them, so on that engine and precision the check asks for identical answers).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.serving.engines import TransformersEngine
from tasks.serving.records import SmokeRecord


def smoke_messages(prompt: Any) -> list[dict[str, str]]:
    """A data row's prompt as the chat messages a client sends (the version's system prompt is added by the server,
    as at training, where the messages have none).

    >>> smoke_messages("2+2?")
    [{'role': 'user', 'content': '2+2?'}]
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def record_smoke(
    engine: TransformersEngine,
    adapter_dir: Path,
    rows: list[dict[str, Any]],
    system_prompt: str | None,
    max_tokens: int,
) -> SmokeRecord:
    """The greedy answers of ``adapter_dir`` to the prompts of ``rows``, on ``engine`` (loaded and let go here)."""
    prompts = [smoke_messages(row["prompt"]) for row in rows]
    key = f"smoke-{Path(adapter_dir).name}"
    engine.load(key, adapter_dir)
    try:
        answers = [
            engine.chat(key, messages, system_prompt, max_tokens=max_tokens, threads=1, priority=True)[0].text
            for messages in prompts
        ]
    finally:
        engine.unload(key)
    return SmokeRecord(prompts, answers, engine.name, engine.precision, max_tokens, system_prompt, engine.device)
