"""The rollout ledger: every sample GRPO generated — prompt, completion, token counts, each reward function's value
and the weighted total, the group's advantage, whether the loss trained on it — kept as Parquet parts in the
stage's ``rollouts/`` folder. Probes and evaluation write theirs the same way, with a role instead of a step.

A part covers the steps since the last one and is written at each checkpoint (so ``--resume`` from checkpoint N
keeps exactly the rows of steps ≤ N, each once: the parts also travel inside the checkpoint), every
``flush_every`` steps when checkpoints are off, and at the end.

The schema has one version, ``LEDGER_SCHEMA_VERSION``, stored in each part's Parquet metadata. A change to what a
row holds bumps it, and every reader (``read_ledger`` and what it feeds: ``grpoflow rollouts``, ``rescore``, the
audit) changes in the same commit; ``read_ledger`` reads every older version and refuses a newer one by name.
Version 2 (tool use): a rollout that may call tools keeps its conversation in ``turns`` (JSON: each message, a tool
answer with its call's time, failure and kind), ``tool_calls``, ``tool_errors``, ``tool_turns_dropped`` (calls
whose answer TRL dropped because it would pass ``max_completion_length``) and, in GRPO, ``trained_tokens`` (the
tokens the loss reads: ``completion_mask * tool_mask``) and ``tool_tokens``; ``completion`` is the conversation as
text. Version 1 rows read with those columns absent.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from tasks.errors import UserError

LEDGER_DIR = "rollouts"
REWARD_PREFIX = "reward/"
LEDGER_SCHEMA_VERSION = 2
SCHEMA_KEY = b"grpoflow.ledger_schema"


def write_part(folder: Path, rows: Sequence[dict[str, Any]], name: str) -> Path | None:
    """Write ``rows`` as ``folder/name.parquet`` (atomically); None when there are none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(key for row in rows for key in row))
    table = pa.table({key: [row.get(key) for row in rows] for key in names})
    table = table.replace_schema_metadata({SCHEMA_KEY: str(LEDGER_SCHEMA_VERSION).encode()})
    target = folder / f"{name}.parquet"
    staging = target.with_suffix(".parquet.tmp")
    pq.write_table(table, staging, compression="zstd")
    staging.replace(target)
    return target


def read_ledger(folder: Path) -> list[dict[str, Any]]:
    """Every row of every part in ``folder``, parts in name order (steps ascending), rows in the order written.
    A part written by a newer grpoflow (a higher schema version) is refused by name."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for part in sorted(Path(folder).glob("*.parquet")):
        table = pq.read_table(part)
        version = schema_version(table.schema.metadata)
        if version > LEDGER_SCHEMA_VERSION:
            raise UserError(
                f"{part}: rollout ledger schema {version}, newer than this grpoflow reads "
                f"({LEDGER_SCHEMA_VERSION}): read it with the grpoflow that wrote it, or upgrade"
            )
        rows.extend(table.to_pylist())
    return rows


def schema_version(metadata: dict[bytes, bytes] | None) -> int:
    """A part's ledger schema version from its Parquet metadata; parts written before the version existed are 1.

    >>> schema_version({b"grpoflow.ledger_schema": b"2"}), schema_version(None)
    (2, 1)
    """
    return int((metadata or {}).get(SCHEMA_KEY, b"1"))


def part_name(first_step: int, last_step: int) -> str:
    """The name of a GRPO part: its step range, zero-padded so names sort by step.

    >>> part_name(1, 10)
    'grpo-000001-000010'
    """
    return f"grpo-{first_step:06d}-{last_step:06d}"


def reward_values(row: dict[str, Any]) -> dict[str, float | None]:
    """A ledger row's reward columns by function name.

    >>> reward_values({"step": 1, "reward/math_accuracy": 1.0, "reward/boxed_format": None})
    {'math_accuracy': 1.0, 'boxed_format': None}
    """
    return {key[len(REWARD_PREFIX) :]: value for key, value in row.items() if key.startswith(REWARD_PREFIX)}


def conversation_text(messages: Sequence[dict[str, Any]]) -> str:
    """A tool-using completion as one text: each assistant turn's words and calls, each tool answer in brackets.

    >>> conversation_text([{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    ...     "name": "python", "arguments": {"code": "print(6*7)"}}}]}, {"role": "tool", "name": "python",
    ...     "content": "42"}, {"role": "assistant", "content": "It is 42."}]).split("\\n")
    ['<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>', '[python: 42]', 'It is 42.']
    """
    parts = []
    for message in messages:
        if message.get("role") == "tool":
            parts.append(f"[{message.get('name', 'tool')}: {message.get('content', '')}]")
            continue
        text = str(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            payload = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
            text += ("\n" if text else "") + f"<tool_call>{payload}</tool_call>"
        parts.append(text)
    return "\n".join(parts)


def completion_columns(completion: Any, calls: Sequence[Any] | None = None) -> dict[str, Any]:
    """A completion's ledger columns: a plain one is its text; a conversation (tool use) is its text, its turns (a
    tool answer joined with its call's record: time, failure, kind) and its counts of calls, failures and answers
    dropped (a call recorded by the tools whose answer is not in the conversation: TRL drops one that would pass
    ``max_completion_length``).

    >>> completion_columns("4")
    {'completion': '4'}
    >>> row = completion_columns([{"role": "assistant", "content": "4"}], [{"seconds": 0.1, "failed": True}])
    >>> row["tool_calls"], row["tool_errors"], row["tool_turns_dropped"]
    (1, 1, 1)
    """
    if isinstance(completion, str):
        return {"completion": completion}
    records = [record if isinstance(record, dict) else vars(record) for record in calls or []]
    turns, answered = [], 0
    for message in completion:
        turn = dict(message)
        if message.get("role") == "tool" and answered < len(records):
            record = records[answered]
            turn.update(seconds=record.get("seconds"), failed=record.get("failed"), kind=record.get("kind"))
            answered += 1
        turns.append(turn)
    return {
        "completion": conversation_text(completion),
        "turns": json.dumps(turns, default=str),
        "tool_calls": len(records),
        "tool_errors": sum(bool(record.get("failed")) for record in records),
        "tool_turns_dropped": len(records) - answered,
    }


def conversation(row: dict[str, Any]) -> Any:
    """What a reward reads of a ledger row: the conversation (messages, tool turns included) of a tool-using rollout,
    else the completion text (rows of schema 1 included).

    >>> conversation({"completion": "4"}), conversation({"completion": "4", "turns": '[{"role": "assistant"}]'})
    ('4', [{'role': 'assistant'}])
    """
    turns = row.get("turns")
    if not turns:
        return row["completion"]
    return [{k: v for k, v in turn.items() if k not in ("seconds", "failed", "kind")} for turn in json.loads(turns)]


def sample_rows(
    role: str,
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[Any]],
    per_function: dict[str, Any],
    totals: Any,
    backend: str,
) -> list[dict[str, Any]]:
    """Probe's or evaluation's samples as ledger rows: one per completion (text, or a tool-using conversation with
    its ``calls``' records: ``tasks.models.Conversation``), with its rewards (``per_function``: name → prompts ×
    samples array; ``totals`` the weighted sums)."""
    out = []
    for i, row in enumerate(rows):
        columns = {k: v for k, v in row.items() if k not in ("id", "prompt")}
        for j, completion in enumerate(completions[i]):
            rewards = {f"{REWARD_PREFIX}{name}": _plain(values[i, j]) for name, values in per_function.items()}
            out.append(
                {
                    "role": role,
                    "step": None,
                    "prompt_id": str(row.get("id", i)),
                    "prompt": str(row["prompt"]),
                    **completion_columns(completion, getattr(completion, "calls", None)),
                    "sample": j,
                    **rewards,
                    "reward_total": _plain(totals[i, j]),
                    "backend": backend,
                    "columns": json.dumps(columns, default=str),
                }
            )
    return out


def _plain(value: Any) -> float | None:
    value = float(value)
    return None if value != value else value


class LedgerRecorder:
    """Rows GRPO committed and not yet written; ``flush`` writes them as one part."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.buffer: list[dict[str, Any]] = []
        self.bytes_written = 0
        self.seconds = 0.0

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        self.buffer.extend(rows)

    def flush(self) -> Path | None:
        """Write the buffered rows as the part of their step range; returns it (None when empty)."""
        if not self.buffer:
            return None
        started = time.perf_counter()
        steps = [row["step"] for row in self.buffer]
        part = write_part(self.folder, self.buffer, part_name(min(steps), max(steps)))
        self.buffer = []
        if part is not None:
            self.bytes_written += part.stat().st_size
        self.seconds += time.perf_counter() - started
        return part

    def restore(self, checkpoint: Path | None) -> None:
        """Start the ledger over (a fresh run) or as it was at a checkpoint (``--resume``): the checkpoint's copy,
        or — a kill between the checkpoint and its copy — the parts up to its step. Rows of later steps go; they
        are generated again."""
        if checkpoint is None:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        saved = checkpoint / LEDGER_DIR
        if saved.is_dir():
            shutil.rmtree(self.folder, ignore_errors=True)
            shutil.copytree(saved, self.folder)
            return
        step = int(checkpoint.name.rsplit("-", 1)[-1])
        for part in self.folder.glob("grpo-*.parquet"):
            if int(part.stem.rsplit("-", 1)[-1]) > step:
                part.unlink()


class LedgerCallback(TrainerCallback):
    """Writes the ledger's parts: at each checkpoint (and a copy inside it), every ``flush_every`` steps when
    checkpoints are off, and at the end; hands ``sink`` a sample of each step's rows (an MLflow table)."""

    def __init__(
        self,
        recorder: LedgerRecorder,
        flush_every: int,
        checkpoints: bool,
        sink: Callable[[int, dict[str, list[Any]]], None] | None = None,
        sample_every: int = 1,
        sample_rows: int = 16,
    ) -> None:
        self.recorder, self.flush_every, self.checkpoints = recorder, flush_every, checkpoints
        self.sink, self.sample_every, self.sample_rows = sink, sample_every, sample_rows
        self._sampled_up_to = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if self.sink is not None and self.sample_every and step % self.sample_every == 0:
            rows = [r for r in self.recorder.buffer if r["step"] > self._sampled_up_to][: self.sample_rows]
            if rows:
                table = {key: [r.get(key) for r in rows] for key in rows[0] if key != "columns"}
                table["prompt"] = [str(p)[-300:] for p in table["prompt"]]
                self.sink(step, table)
            self._sampled_up_to = step
        if not self.checkpoints and self.flush_every and step % self.flush_every == 0:
            self.recorder.flush()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.flush()
        if not state.is_world_process_zero:  # rank 0 keeps the ledger
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if checkpoint.is_dir() and self.recorder.folder.is_dir():  # the copy travels with the checkpoint
            staging = checkpoint / f".{LEDGER_DIR}.staging"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(self.recorder.folder, staging)
            staging.rename(checkpoint / LEDGER_DIR)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.flush()
