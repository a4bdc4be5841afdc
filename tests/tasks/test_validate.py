"""The validate stage on messy data: every bad row quarantined with a reason, every good row kept."""

import json
import math
import re
from pathlib import Path

import pytest

from tasks.config import DataSettings, load_config
from tasks.inputs import fingerprint, holdout_side, normalize_math
from tasks.validate import QuarantineLimitExceeded, enforce_limits, run_validate, validate_rows

GOOD = [
    {"id": "g1", "prompt": "What is 2 + 2?", "ground_truth": "4"},
    {"id": "g2", "prompt": [{"role": "user", "content": "What is 10 + 5?"}], "ground_truth": "#### 15"},
    {"id": "g3", "prompt": "Half of one?", "ground_truth": "\\boxed{\\frac{1}{2}}"},
    {"id": "g4", "prompt": "How many dollars?", "ground_truth": "$1,234"},
    {"id": "g5", "prompt": "Same row twice", "ground_truth": "7"},
]

# (row, a word the reason must contain)
BAD = [
    ({"id": "b1", "ground_truth": "1"}, "missing column 'prompt'"),
    ({"id": "b2", "prompt": "p2"}, "missing column 'ground_truth'"),
    ({"id": "b3", "prompt": None, "ground_truth": "1"}, "prompt is null"),
    ({"id": "b4", "prompt": "", "ground_truth": "1"}, "empty"),
    ({"id": "b5", "prompt": "   \n\t", "ground_truth": "1"}, "whitespace"),
    ({"id": "b6", "prompt": 42, "ground_truth": "1"}, "prompt has type int"),
    ({"id": "b7", "prompt": "p7", "ground_truth": None}, "ground_truth is null"),
    ({"id": "b8", "prompt": "p8", "ground_truth": ""}, "ground_truth is empty"),
    ({"id": "b9", "prompt": "p9", "ground_truth": ["4"]}, "ground_truth has type list"),
    ({"id": "b10", "prompt": "p10", "ground_truth": math.nan}, "ground_truth is null"),
    ({"id": "b11", "prompt": "p11", "ground_truth": "\\frac{"}, "not parseable by math-verify"),
    ({"id": "b12", "prompt": "p12", "ground_truth": {"a": {"b": [1]}}}, "ground_truth has type dict"),
    ({"id": "b13", "prompt": "x" * 5000, "ground_truth": "1"}, "outside [1, 4000]"),
    ({"id": "b14", "prompt": "bad \ud800 surrogate", "ground_truth": "1"}, "lone surrogate"),
    ({"id": "b15", "prompt": [{"role": "user"}], "ground_truth": "1"}, "not a {role, content} object"),
    ({"id": "b16", "prompt": [{"role": "robot", "content": "hi"}], "ground_truth": "1"}, "role 'robot'"),
    ({"id": "b17", "prompt": [], "ground_truth": "1"}, "empty message list"),
    ({"id": "b18", "prompt": "p18", "ground_truth": True}, "ground_truth has type bool"),
    ({"id": ["x"], "prompt": "p19", "ground_truth": "1"}, "id has type list"),
    ({"id": "b20", "prompt": "p20", "ground_truth": math.inf}, "ground_truth is inf"),
    ({"id": "b21", "prompt": [{"role": "user", "content": 5}], "ground_truth": "1"}, "content is not a string"),
    ("just a string", "row is a str"),
    ({"id": "b23", "prompt": "p23", "ground_truth": "1", "completion": ["x"]}, "completion has type list"),
    ({"id": "b24", "prompt": "p24", "ground_truth": "   "}, "whitespace"),
    ({"id": "b25", "prompt": "p25", "ground_truth": "???"}, "not parseable by math-verify"),
    ({"id": None, "prompt": "p26", "ground_truth": "1"}, "id is null"),
    ({"id": "  ", "prompt": "p27", "ground_truth": "1"}, "id is empty"),
    ({"id": "b28", "prompt": "\x00\x01\x7f", "ground_truth": "1"}, "prompt has no printable characters"),
    ({"id": "b29", "prompt": "p29", "ground_truth": "see the figure"}, "is words, not a mathematical answer"),
    ({"id": "b30", "prompt": "p30", "ground_truth": "\\boxed{undefined}"}, "is words, not a mathematical answer"),
]

DUPLICATES = [
    # the same row twice: the first is kept, the second quarantined
    ({"id": "g5", "prompt": "Same row twice", "ground_truth": "7"}, "duplicate of row 'g5'"),
    # an id reused with other content
    ({"id": "g1", "prompt": "A different question", "ground_truth": "9"}, "id 'g1' reused"),
]
CONFLICT = [
    {"id": "c1", "prompt": "What is 3 + 3?", "ground_truth": "6"},
    {"id": "c2", "prompt": "What is 3 + 3?  ", "ground_truth": "7"},
]


def test_every_bad_row_is_quarantined_with_its_reason_and_good_rows_kept() -> None:
    raw = GOOD + [row for row, _ in BAD] + [row for row, _ in DUPLICATES] + CONFLICT
    kept, quarantined, gx = validate_rows(raw, DataSettings(kind="math"))
    assert [row["id"] for row in kept] == [row["id"] for row in GOOD]
    assert len(kept) + len(quarantined) == len(raw)  # counts reconcile: nothing silently dropped
    reasons_by_index = {record["row_index"]: " ".join(record["reasons"]) for record in quarantined}
    expectations = BAD + DUPLICATES
    for offset, (row, expected) in enumerate(expectations):
        index = len(GOOD) + offset
        assert expected in reasons_by_index[index], (row, reasons_by_index.get(index))
        assert quarantined[[r["row_index"] for r in quarantined].index(index)]["row"] == row  # original kept
    conflict_reasons = [reasons_by_index[len(raw) - 2], reasons_by_index[len(raw) - 1]]
    assert all("conflicting ground truth" in reason for reason in conflict_reasons)
    assert gx["success"] is True


def test_a_row_with_several_problems_lists_them_all() -> None:
    _, quarantined, _ = validate_rows([{"id": ["x"], "prompt": 7, "ground_truth": "\\frac{"}], DataSettings())
    assert len(quarantined[0]["reasons"]) == 3
    assert "prompt has type int" in quarantined[0]["reasons"][0]
    assert "not parseable" in quarantined[0]["reasons"][1]
    assert "id has type list" in quarantined[0]["reasons"][2]


def test_normalized_ground_truth_keeps_the_raw_value() -> None:
    kept, _, _ = validate_rows(GOOD, DataSettings(kind="math"))
    assert [(r["ground_truth"], r["ground_truth_raw"]) for r in kept][:4] == [
        ("4", "4"),
        ("15", "#### 15"),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}"),
        ("1234", "$1,234"),
    ]


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [("#### 72", "72"), ("1,000,000", "1000000"), ("3.50", "3.5"), ("-0", "0"), ("12 cm", "12"), (18.0, "18")],
)
def test_math_normalization(raw: object, normalized: str) -> None:
    assert normalize_math(raw) == normalized


def test_labels_and_json_and_code() -> None:
    label_rows = [
        {"id": "1", "prompt": "p1", "ground_truth": " POSITIVE "},
        {"id": "2", "prompt": "p2", "ground_truth": "meh"},
    ]
    kept, quarantined, _ = validate_rows(label_rows, DataSettings(kind="label", labels=["positive", "negative"]))
    assert kept[0]["ground_truth"] == "positive"
    assert "not in the allowed set" in quarantined[0]["reasons"][0]
    per_row = [
        {"id": "1", "prompt": "p1", "ground_truth": "Cat", "labels": ["cat", "dog"]},
        {"id": "2", "prompt": "p2", "ground_truth": "cat"},
    ]
    kept, quarantined, _ = validate_rows(per_row, DataSettings(kind="label"))
    assert kept[0]["ground_truth"] == "cat"
    assert "no allowed label set" in quarantined[0]["reasons"][0]
    json_rows = [
        {"id": "1", "prompt": "p", "ground_truth": '{"b":1, "a":2}'},
        {"id": "2", "prompt": "q", "ground_truth": "{"},
    ]
    kept, quarantined, _ = validate_rows(json_rows, DataSettings(kind="json"))
    assert kept[0]["ground_truth"] == '{"a":2,"b":1}'
    assert "not valid JSON" in quarantined[0]["reasons"][0]
    code_rows = [
        {"id": "1", "prompt": "p", "ground_truth": "x", "tests": "assert f() == 1"},
        {"id": "2", "prompt": "q", "ground_truth": "x", "tests": "assert f( == 1"},
    ]
    kept, quarantined, _ = validate_rows(code_rows, DataSettings(kind="code"))
    assert [r["id"] for r in kept] == ["1"]
    assert "syntax error" in quarantined[0]["reasons"][0]


def test_split_is_stable_when_rows_are_added() -> None:
    prompts = [f"What is {i} + {i}?" for i in range(400)]
    sides = {p: holdout_side(p, 0.2) for p in prompts}
    more = prompts + [f"New question {i}" for i in range(400)]
    assert all(holdout_side(p, 0.2) == sides[p] for p in more[:400])
    share = sum(sides.values()) / len(sides)
    assert 0.12 < share < 0.28


def test_fingerprint_is_order_independent_and_content_sensitive() -> None:
    kept, _, _ = validate_rows(GOOD, DataSettings())
    assert fingerprint(kept) == fingerprint(list(reversed(kept)))
    assert fingerprint(kept) != fingerprint(kept[:-1])


def test_stage_writes_files_and_enforces_the_quarantine_limit(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in GOOD] + ['{"broken json', json.dumps({"id": "z", "prompt": "p"})]
    data.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "\xff\xfe", "ground_truth": "1"}\n')
    config = load_config(overrides={"data.source": str(data), "data.max_quarantine_share": 0.2})
    result = run_validate(config, tmp_path / "validate")
    assert (result.rows_in, result.rows_kept, result.rows_quarantined) == (8, 5, 3)
    quarantined = [json.loads(line) for line in result.quarantine_path.read_text().splitlines()]
    reasons = " ".join(" ".join(q["reasons"]) for q in quarantined)
    assert "invalid JSON on line 6" in reasons and "invalid UTF-8" in reasons and "missing column" in reasons
    with pytest.raises(QuarantineLimitExceeded, match="3/8 rows quarantined"):
        enforce_limits(result, config)
    assert (tmp_path / "validate" / "data_docs" / "index.html").is_file()  # GX Data Docs for the audit


def test_great_expectations_audit_names_failing_rows(tmp_path: Path) -> None:
    from tasks.inputs import gx_audit

    rows = [
        {"id": "a", "prompt": "fine", "ground_truth": "1"},
        {"id": "a", "prompt": "same id", "ground_truth": "2"},
        {"id": "c", "prompt": "y" * 50, "ground_truth": "3"},
    ]
    failing, summary = gx_audit(rows, DataSettings(max_prompt_chars=20), tmp_path / "docs")
    assert summary["success"] is False
    assert any("ExpectColumnValuesToBeUnique" in r or "unique" in r for r in failing["a"])
    assert any("between" in r for r in failing["c"])
    assert (tmp_path / "docs" / "index.html").is_file()


def test_relative_output_dir_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(overrides={"data.arithmetic.num_rows": 50})
    result = run_validate(config, Path("outputs") / "validate")  # as configs/demo.yaml has it: relative
    assert result.rows_kept == 50
    assert (tmp_path / "outputs" / "validate" / "data_docs" / "index.html").is_file()


def test_hostile_rows_are_all_written_and_accounted_for(tmp_path: Path) -> None:
    """A lone surrogate (valid JSON, invalid UTF-8), null and empty ids, control-character prompts, prose math
    answers and unreadable lines: every row lands in exactly one output, every output file is valid UTF-8 JSONL,
    and the raw value of a quarantined row comes back from it unchanged."""
    lines = [
        json.dumps({"id": "ok1", "prompt": "What is 1 + 1?", "ground_truth": "2"}),
        '{"id": "sur", "prompt": "bad \\ud800 text", "ground_truth": "1"}',
        json.dumps({"id": None, "prompt": "What is 2 + 2?", "ground_truth": "4"}),
        json.dumps({"id": "ctl", "prompt": "\u0001\u0002", "ground_truth": "1"}),
        json.dumps({"id": "words", "prompt": "Which figure?", "ground_truth": "see the figure"}),
        "{not json",
        json.dumps({"id": "ok2", "prompt": "What is 3 + 4?", "ground_truth": "7"}),
    ]
    data = tmp_path / "rows.jsonl"
    data.write_bytes(("\n".join(lines) + "\n").encode("utf-8") + b"\xff\xfe broken line\n")
    config = load_config(None, {"data": {"source": str(data), "holdout_fraction": 0.5}})
    result = run_validate(config, tmp_path / "validate")
    assert result.rows_in == 8 == result.rows_kept + result.rows_quarantined
    assert (result.rows_kept, result.rows_unreadable) == (2, 2)
    outputs = {}
    for path in (result.train_path, result.holdout_path, result.quarantine_path):
        outputs[path.name] = [json.loads(line) for line in path.read_bytes().decode("utf-8").splitlines()]
    assert len(outputs["train.jsonl"]) + len(outputs["holdout.jsonl"]) == 2
    quarantined = {json.dumps(r["row"], sort_keys=True): r["reasons"] for r in outputs["quarantine.jsonl"]}
    rows = [r for r in outputs["quarantine.jsonl"] if isinstance(r["row"], dict)]
    surrogate = next(r for r in rows if r["row"].get("id") == "sur")
    assert surrogate["row"]["prompt"] == "bad \ud800 text" and "lone surrogate" in surrogate["reasons"][0]
    assert len(quarantined) == 6
    report = json.loads(result.report_path.read_text())
    assert report["rows_unreadable"] == 2
    labels = set(result.reasons)
    assert {"id is null", "prompt has no printable characters", "invalid UTF-8", "invalid JSON on line N"} <= labels
    assert "math answer '…' is words, not a mathematical answer (use data.kind exact or label)" in labels


def test_a_crash_while_writing_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from tasks.inputs import write_jsonl

    target = tmp_path / "train.jsonl"
    write_jsonl(target, [{"a": 1}])

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_jsonl(target, [{"a": 2}] * 1000)
    assert target.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["train.jsonl"]  # no partial or temporary file left


def test_a_math_reward_that_credits_unboxed_answers_fails_validate_on_the_canaries(
    tiny_config, tmp_path, monkeypatch
) -> None:
    import reward_fns.math
    from tasks.validate import RewardCanaryFailed, run_validate

    def credits_unboxed(completions, ground_truth, **kwargs):  # a "fix" that accepts the number anywhere
        return [float(str(g) in str(c)) for c, g in zip(completions, ground_truth, strict=True)]

    monkeypatch.setattr(reward_fns.math, "math_accuracy", credits_unboxed)
    with pytest.raises(RewardCanaryFailed) as failure:
        run_validate(tiny_config, tmp_path / "validate")
    message = str(failure.value)
    named = r"reward canary failed: math_accuracy on '[^']+' \(math\.jsonl:\d+\): expected 1\.0, got 0\.0"
    assert re.search(named, message)
    assert "more in" in message
    assert len(message.splitlines()) <= 2 and failure.value.exit_code == 3
    report = json.loads((tmp_path / "validate" / "canaries.json").read_text())
    assert {d["function"] for d in report["disagreements"]} == {"math_accuracy"}
    unboxed = next(d for d in report["disagreements"] if d["case"] == "wrong: right number, no box")
    assert (unboxed["expected"], unboxed["got"]) == (0.0, 1.0)
    assert not (tmp_path / "validate" / "train.jsonl").exists()  # stopped before the data was split


def test_a_custom_reward_is_checked_on_the_configs_own_canaries(tiny_config, tmp_path) -> None:
    from tasks.config import load_config
    from tasks.validate import RewardCanaryFailed, run_validate

    (tmp_path / "shout.py").write_text(
        "def shouted(completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n"
    )
    (tmp_path / "canaries.jsonl").write_text(
        '{"case": "correct: loud", "completion": "YES", "expect": {"shouted": 1.0}}\n'
        '{"case": "wrong: quiet", "completion": "yes", "expect": {"shouted": 0.0}}\n'
    )
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        "model: {source: tiny-random}\ndata: {arithmetic: {num_rows: 40}}\n"
        "rewards: [{name: 'shout:shouted'}, {name: boxed_format, weight: 0.1}]\ncanaries: {file: canaries.jsonl}\n"
    )
    config = load_config(config_file, {"output_dir": str(tmp_path / "out")})
    run_validate(config, tmp_path / "ok")
    report = json.loads((tmp_path / "ok" / "canaries.json").read_text())
    assert report["checks"]["shouted"] == 2 and report["checks"]["boxed_format"] > 5 and not report["unchecked"]

    (tmp_path / "canaries.jsonl").write_text('{"case": "quiet", "completion": "yes", "expect": {"shouted": 1.0}}\n')
    with pytest.raises(RewardCanaryFailed, match=r"shouted on 'quiet' \(canaries\.jsonl:1\): expected 1\.0, got 0\.0"):
        run_validate(config, tmp_path / "bad")


def test_the_same_data_gives_the_same_split_digests(tiny_config, tiny_split, tmp_path) -> None:
    """Each split's MLflow dataset digest is grpoflow's fingerprint of its rows: validating the same data again
    gives the same digests; the two splits differ."""
    from tasks.inputs import fingerprint, read_jsonl
    from tasks.validate import run_validate

    again = run_validate(tiny_config, tmp_path / "again")
    assert (again.train_digest, again.holdout_digest) == (tiny_split.train_digest, tiny_split.holdout_digest)
    assert again.train_digest == fingerprint(read_jsonl(again.train_path)) != again.holdout_digest
    assert {"prompt", "ground_truth", "id"} <= set(again.columns)


def test_a_test_source_is_checked_like_the_data_leaks_are_quarantined_and_evaluation_scores_it(tmp_path) -> None:  # noqa: ANN001
    """data.test_source (the official test split, say) is read with the same columns and checks; a training row whose
    prompt the test set holds is quarantined as a leak; nothing is lost; the final evaluation reads the test rows
    (the hold-out still exists for GRPO's steering)."""
    import json

    from tasks.config import load_config
    from tasks.evaluate import holdout_rows
    from tasks.inputs import read_jsonl
    from tasks.validate import run_validate

    train = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(40)]
    test = [{"question": f"What is {i} + 100?", "answer": f"#### {i + 100}"} for i in range(6)]
    test.append({"question": "What is 3 + 3?", "answer": "#### 6"})  # also a training prompt: a leak
    test.append({"question": "Broken?", "answer": "#### not a number"})  # a bad test row
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    data = {
        "source": str(tmp_path / "train.jsonl"),
        "test_source": str(tmp_path / "test.jsonl"),
        "columns": {"prompt": "question", "ground_truth": "answer"},
        "holdout_fraction": 0.2,
    }
    config = load_config(overrides={"data": data, "evaluation.num_prompts": 5})
    result = run_validate(config, tmp_path / "validate")
    assert result.test["rows_in"] == 8 and result.test["rows_kept"] == 7 and result.test["leaks"] == 1
    kept = read_jsonl(result.train_path) + read_jsonl(result.holdout_path)
    assert len(kept) == 39 and "What is 3 + 3?" not in {row["prompt"] for row in kept}
    reasons = [r["reasons"][0] for r in read_jsonl(result.quarantine_path)]
    assert "leak: data.test_source holds this prompt" in reasons and len(reasons) == 2
    scored = holdout_rows(config, result.holdout_path)
    assert [row["prompt"] for row in scored] == [f"What is {i} + 100?" for i in range(5)]
