"""Promotion and rollback on a real MLflow store (SQLite in a temp dir)."""

import random
from pathlib import Path

import numpy as np
import pytest

from tasks.config import PromotionSettings
from tasks.evaluation import paired_difference
from tasks.layout import RunLayout
from tasks.promote import PromotionCase, decide_promotion, run_promote
from tasks.registry import (
    CHALLENGER,
    CHAMPION,
    RegistryError,
    alias_version,
    client_for,
    fetch_adapter,
    rollback_champion,
)
from tasks.tracking import start_pipeline


def test_gate_never_promotes_a_worse_pass1_on_random_pairs(make_scores) -> None:
    scores = make_scores
    rng = random.Random(0)
    settings = PromotionSettings()
    promoted = 0
    for trial in range(300):
        prompts = rng.randint(5, 60)
        reference = [rng.choice([0, 0.25, 0.5, 0.75, 1.0]) for _ in range(prompts)]
        shift = rng.uniform(-0.5, 0.5)
        candidate = [min(1.0, max(0.0, r + rng.choice([0, 0.25, -0.25]) + shift)) for r in reference]
        candidate = [round(c * 4) / 4 for c in candidate]
        difference = paired_difference(candidate, reference, 500, trial)
        case = PromotionCase(scores("grpo", candidate), scores("base", reference), difference)
        ok, reason = decide_promotion(case, settings)
        if ok:
            promoted += 1
            assert np.mean(candidate) > np.mean(reference), reason
    assert promoted > 20  # the gate does promote clear gains


def promote(config, tracker, adapter_dir, candidate, reference, champion):
    with tracker.stage("promote") as stage:
        case = PromotionCase(
            candidate,
            reference,
            paired_difference(candidate.per_prompt_pass1, reference.per_prompt_pass1),
            champion_version=champion,
        )
        lineage = {"base_model": "tiny-random", "pipeline_run_id": tracker.run_id}
        name = config.tracking.registered_model_name
        return run_promote(stage, name, case, config.promotion, lineage, adapter_dir, adapter_dir)


def test_better_promoted_worse_not_and_rollback_restores(tiny_config, tiny_adapter, tmp_path, make_scores) -> None:
    scores = make_scores
    config = tiny_config
    name = config.tracking.registered_model_name
    client = client_for(config.resolved_tracking_uri())
    tracker = start_pipeline(config, RunLayout(tmp_path / "run-1"))
    base = scores("base", [0.0, 0.25] * 20)
    good = scores("grpo", [0.75, 1.0] * 20)
    first = promote(config, tracker, tiny_adapter, good, base, None)
    assert first.promoted and first.version == "1" and first.sft_version == "1"
    assert str(alias_version(client, name, CHAMPION).version) == "1"
    version = client.get_model_version(name, "1")
    assert version.tags["base_model"] == "tiny-random" and version.tags["pipeline_run_id"] == "run-1"
    assert client.get_model_version(f"{name}-sft", "1")

    # A worse candidate, compared with the champion: registered, not promoted, reason recorded.
    worse = scores("grpo", [0.5, 0.5] * 20)
    tracker = start_pipeline(config, RunLayout(tmp_path / "run-2"))
    second = promote(config, tracker, tiny_adapter, worse, scores("champion", good.per_prompt_pass1), "1")
    assert not second.promoted and "does not exceed the margin" in second.reason
    assert str(alias_version(client, name, CHAMPION).version) == "1"
    assert str(alias_version(client, name, CHALLENGER).version) == "2"
    assert "margin" in client.get_model_version(name, "2").tags["grpoflow.promotion_decision"]

    # A better one becomes champion; rollback moves the alias back and the alias then loads the old one.
    tracker = start_pipeline(config, RunLayout(tmp_path / "run-3"))
    third = promote(config, tracker, tiny_adapter, scores("grpo", [1.0] * 40), scores("champion", [0.5] * 40), "1")
    assert third.promoted and str(alias_version(client, name, CHAMPION).version) == "3"
    assert rollback_champion(client, name, reason="test") == "1"
    assert str(alias_version(client, name, CHAMPION).version) == "1"
    base_source, local, loaded = fetch_adapter(
        config.resolved_tracking_uri(), f"models:/{name}@champion", tmp_path / "d"
    )
    assert base_source == "tiny-random" and str(loaded.version) == "1"
    assert (local / "adapter_config.json").is_file()


def test_champion_moved_during_evaluation_blocks_promotion(tiny_config, tiny_adapter, tmp_path, make_scores) -> None:
    scores = make_scores
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run-a"))
    base = scores("base", [0.0] * 20)
    promote(tiny_config, tracker, tiny_adapter, scores("grpo", [0.5] * 20), base, None)
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run-b"))
    # This run evaluated with no champion present, but another run promoted meanwhile.
    late = promote(tiny_config, tracker, tiny_adapter, scores("grpo", [1.0] * 20), base, None)
    assert not late.promoted and "champion moved" in late.reason


def test_rollback_without_history_is_a_clear_error(tiny_config, tiny_adapter, tmp_path, make_scores) -> None:
    scores = make_scores
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run-b"))
    promote(tiny_config, tracker, tiny_adapter, scores("grpo", [1.0] * 20), scores("base", [0.0] * 20), None)
    with pytest.raises(RegistryError, match="no earlier champion"):
        rollback_champion(client_for(tiny_config.resolved_tracking_uri()), tiny_config.tracking.registered_model_name)


def test_a_resumed_run_registers_once(tiny_config, tiny_adapter, tmp_path, make_scores) -> None:
    scores = make_scores
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run-once"))
    first = promote(tiny_config, tracker, tiny_adapter, scores("grpo", [1.0] * 20), scores("base", [0.0] * 20), None)
    again = promote(tiny_config, tracker, tiny_adapter, scores("grpo", [1.0] * 20), scores("base", [0.0] * 20), None)
    assert first.version == again.version == "1" and first.sft_version == again.sft_version == "1"
    assert first.promoted and again.promoted and again.reason == "already champion"
    client = client_for(tiny_config.resolved_tracking_uri())
    assert len(client.search_model_versions(f"name = '{tiny_config.tracking.registered_model_name}'")) == 1


def test_an_unknown_model_is_a_user_error_naming_it_and_the_store(tiny_config) -> None:
    from tasks.registry import ModelNotFound, fetch_adapter

    uri = tiny_config.resolved_tracking_uri()
    with pytest.raises(ModelNotFound, match=f"no registered model 'nope' at {uri}") as error:
        rollback_champion(client_for(uri), "nope")
    assert error.value.exit_code == 2
    with pytest.raises(ModelNotFound, match="models:/nope@champion does not exist"):
        fetch_adapter(uri, "models:/nope@champion", Path("/tmp/unused"))


def test_an_audit_finding_rejects_only_with_block_on_audit() -> None:
    from tasks.config import PromotionSettings
    from tasks.evaluate import ModelScores
    from tasks.promote import PromotionCase, decide_promotion

    good = ModelScores("grpo", 4, 4, 0.5, {1: 0.5}, (0.3, 0.7), [], [])
    base = ModelScores("base", 4, 4, 0.1, {1: 0.1}, (0.0, 0.2), [], [])
    finding = {"detector": "length_grew", "message": "completions grew from 6.0 to 30.0 tokens", "numbers": {}}
    case = PromotionCase(good, base, {"mean": 0.4, "low": 0.2, "high": 0.6, "n": 4}, audit=(finding,))
    assert decide_promotion(case, PromotionSettings())[0]  # reported, not blocking, by default
    promoted, reason = decide_promotion(case, PromotionSettings(block_on_audit=True))
    assert not promoted and "length_grew: completions grew from 6.0 to 30.0 tokens" in reason
