"""The tool pipeline through the real flow (configs/tiny-tools.yaml): the tiny model that calls the python tool,
SFT on program-written tool traces, GRPO through TRL's tool loop, evaluation with and without the tool, a
registered version whose card names the tool. The ledger's token counts prove what the loss read: every token of a
tool answer (and the assistant header after it) is masked out, every token the model wrote is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flows.cli import main
from tasks.config import load_config
from tasks.tracking import client_for
from tasks.training import read_ledger

REPO = Path(__file__).resolve().parents[2]


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def grpoflow(*args: str):  # noqa: ANN201
    return CliRunner().invoke(_Command(), list(args))  # type: ignore[arg-type]


def _tool_rounds(turns: list[dict]) -> list[list[dict]]:
    """The tool answers of a conversation, one list per round (the consecutive tool turns after a call)."""
    rounds: list[list[dict]] = []
    previous = None
    for turn in turns:
        if turn["role"] == "tool":
            if previous != "tool":
                rounds.append([])
            rounds[-1].append({"role": "tool", "name": turn["name"], "content": turn["content"]})
        previous = turn["role"]
    return rounds


def test_the_tool_pipeline_trains_on_its_own_tokens_only_and_registers_a_card_with_its_tool(tmp_path: Path) -> None:
    from flows.pipeline import pipeline
    from tasks.environments import prepare_tokenizer, tool_suffix_ids
    from tasks.models import load_tokenizer, resolve_model_source

    # Four GRPO steps (16 rollouts), not the config's two: the check below needs one rollout that calls the tool,
    # and which rollouts do depends on the draws (precision and thread count); 8 rollouts drew none in bf16 on one
    # thread, with the sampler that samples the trained policy, and none in fp32 on one thread before it.
    overrides = {
        "output_dir": str(tmp_path / "outputs"),
        "probe.num_prompts": 2,
        "evaluation.num_prompts": 2,
        "grpo.max_steps": 4,
    }
    config = load_config(REPO / "configs" / "tiny-tools.yaml", overrides)
    summary = pipeline(config, "tiny-tools-e2e")

    assert summary["promotion"]["version"] == "1"
    from flows.summary import print_summary

    print_summary(summary)  # the run's closing table, with and without the tool, from the summary in memory
    models = summary["evaluation"]["models"]
    assert set(models) == {"base", "sft", "grpo"}
    for score in models.values():  # every model scored with the tool and without it, on the same prompts
        assert {"greedy_accuracy", "pass_at_k", "tool_gain"} <= set(score["without_tools"])
        assert score["tool_use"]["calls_per_rollout"] >= 0

    rows = read_ledger(config.output_dir / "tiny-tools-e2e" / "grpo" / "rollouts")
    assert len(rows) == config.grpo.max_steps * config.grpo.batch_size
    tokenizer = load_tokenizer(resolve_model_source(config.model.source))
    prepare_tokenizer(tokenizer, config.tools.chat_template, config.model.source)
    answered = 0
    for row in rows:
        turns = json.loads(row["turns"])
        assert turns[0]["role"] == "assistant" and row["tool_calls"] >= row["tool_errors"] >= 0
        assert row["trained_tokens"] + row["tool_tokens"] == row["completion_tokens"]
        rounds = _tool_rounds(turns)
        # exactly the tool answers and the header after each are out of the loss: TRL's tool_mask, as the ledger
        # read it from completion_mask * tool_mask
        assert row["tool_tokens"] == sum(len(tool_suffix_ids(tokenizer, answers)) for answers in rounds)
        answered += bool(rounds)
    assert answered, "no GRPO rollout called the tool: the mask check above checked nothing"

    client = client_for(config.resolved_tracking_uri())
    version = client.get_model_version(config.tracking.registered_model_name, "1")
    assert version.tags["tools"] == "python"
    card = Path(client.download_artifacts(version.run_id, "", str(tmp_path / "v1")))
    text = next(card.rglob("README.md")).read_text()
    assert "## Tools" in text and "python" in text and "With and without the tools" in text

    # grpoflow rollouts shows each rollout as its conversation; rescore reads the conversations, as training did
    common = ["-c", str(REPO / "configs" / "tiny-tools.yaml"), "--set", f"output_dir={config.output_dir}"]
    shown = grpoflow("rollouts", "tiny-tools-e2e", "--conversation", "--limit", "0", *common)
    assert shown.exit_code == 0, shown.output
    tool_turns = [turn for row in rows for turn in json.loads(row["turns"]) if turn["role"] == "tool"]
    timed = sum(turn.get("seconds") is not None for turn in tool_turns)  # a call the tool ran (else TRL answered it)
    assert shown.output.count("\ntool python (") == timed
    assert shown.output.count("\ntool ") == len(tool_turns)
    table = grpoflow("rollouts", "tiny-tools-e2e", "--limit", "0", *common)
    assert table.exit_code == 0 and "tools" in table.output, table.output  # its column: each row's calls
    rescored = grpoflow("rescore", "tiny-tools-e2e", "--reward", "math_accuracy", *common)
    assert rescored.exit_code == 0, rescored.output
    assert json.loads(rescored.stdout[rescored.stdout.index("{") :])["agreement"] == 1.0
