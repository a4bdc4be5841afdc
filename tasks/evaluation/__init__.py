"""Scoring and statistics: rewards on completions, pass@k (unbiased estimator), bootstrap and paired
intervals, the forgetting check with its general sets (``general_sets/``), and how an evaluation is shown.
Must not import: Prefect, MLflow, a stage.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "model_content_key": "cache",
    "sample_for_evaluation": "cache",
    "DEFAULT_CORPUS": "forgetting",
    "DEFAULT_QUESTIONS": "forgetting",
    "GeneralAbility": "forgetting",
    "fingerprint": "cache",
    "verdict_cache": "cache",
    "judge_bias": "judging",
    "judge_specs": "judging",
    "win_rate": "judging",
    "verdict_lists": "judging",
    "forgetting_items": "jobs",
    "Completions": "jobs",
    "JobShare": "jobs",
    "PolicyShelf": "jobs",
    "forgetting_job": "jobs",
    "sampling_job": "jobs",
    "general_ability": "forgetting",
    "general_questions_trained_on": "forgetting",
    "load_questions": "forgetting",
    "evaluation_table": "report",
    "pass_at_k_curve": "report",
    "watch_table": "report",
    "Finding": "audit",
    "audit_rollouts": "audit",
    "diff_steps": "rollouts",
    "extreme_groups": "rollouts",
    "filter_rows": "rollouts",
    "group_advantages": "rollouts",
    "rescore_report": "rollouts",
    "reward_kwargs": "rollouts",
    "Job": "parallel",
    "processes_for": "parallel",
    "run_jobs": "parallel",
    "bootstrap_interval": "scoring",
    "paired_difference": "scoring",
    "pass_at_k": "scoring",
    "score_groups": "scoring",
    "tool_use_figures": "scoring",
    "describe": "statistics",
    "forgetting_drop": "statistics",
    "forgetting_metrics": "statistics",
    "forgetting_problem": "statistics",
    "minimum_detectable_drop": "statistics",
    "overlapping_questions": "statistics",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
