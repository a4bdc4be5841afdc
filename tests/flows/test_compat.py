"""Stage results that Prefect cached before the restructuring (pickled by the code of commit ff2bd1f, as
Prefect's result store pickles them) load into today's classes, so ``grpoflow run --resume`` of a run started
then reuses them instead of failing."""

from pathlib import Path

import cloudpickle

from tasks.evaluate import EvalResult
from tasks.probe import ProbeResult
from tasks.promote import PromotionCase, decide_promotion
from tasks.training import TrainResult
from tasks.validate import ValidateResult

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pre_restructure_results.pkl"


def test_results_cached_before_the_restructuring_still_load(tiny_config) -> None:
    results = cloudpickle.loads(FIXTURE.read_bytes())
    assert isinstance(results["validate"], ValidateResult) and results["validate"].rows_kept == 9
    assert isinstance(results["probe"], ProbeResult) and results["probe"].has_signal
    assert isinstance(results["train"], TrainResult) and results["train"].last("loss") == 0.1

    evaluation = results["evaluate"]
    assert isinstance(evaluation, EvalResult)
    # Its models were a list [base, sft, champion, grpo]: roles are read from that order.
    assert evaluation.roles == {"base": "base", "sft": "sft", "reference": "champion", "candidate": "grpo"}
    case = PromotionCase.from_evaluation(evaluation)
    assert (case.candidate.name, case.reference.name) == ("grpo", "champion")
    assert case.difference == evaluation.comparisons["grpo-vs-champion"]
    assert case.champion_version is None  # not recorded then: promotion re-checks the alias and refuses a move
    assert decide_promotion(case, tiny_config.promotion)[0] is True
    assert evaluation.to_json()["models"]["grpo"]["greedy_accuracy"] == 0.875


def test_results_pickled_before_a_field_was_added_load_with_its_default() -> None:
    """A run started before the judged rewards resumes after them: its cached validate, probe and model scores lack
    ``judge_canaries``, ``judge_bias`` and ``judged`` (fields with a default factory: no class attribute)."""
    import pickle

    from tasks.evaluate import ModelScores
    from tasks.probe import ProbeResult
    from tasks.validate import ValidateResult

    old = [
        ValidateResult(Path("t"), Path("h"), Path("q"), Path("r"), 1, 1, 0, 1, 0, "f"),
        ProbeResult("base", 1, 1, 0.0, 0.0, {}, 0.0, 0, 0, 0.0, {}),
        ModelScores("base", 1, 1, 0.0, {}, (0.0, 0.0), [], []),
    ]
    for result, added in zip(old, ("judge_canaries", "judge_bias", "judged"), strict=True):
        del result.__dict__[added]
        loaded = pickle.loads(pickle.dumps(result))
        assert getattr(loaded, added) in ([], {})
    assert pickle.loads(pickle.dumps(old[0])).to_json()["judge_canaries"] == []
