"""TODO evaluation"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "general_questions_trained_on": "forgetting",
    "evaluation_table": "report",
    "pass_at_k_curve": "report",
    "watch_table": "report",
    "DEFAULT_CORPUS": "forgetting",
    "DEFAULT_QUESTIONS": "forgetting",
    "GeneralAbility": "forgetting",
    "fingerprint": "forgetting",
    "general_ability": "forgetting",
    "load_questions": "forgetting",
    "bootstrap_interval": "scoring",
    "paired_difference": "scoring",
    "pass_at_k": "scoring",
    "score_groups": "scoring",
    "describe": "statistics",
    "forgetting": "statistics",
    "forgetting_metrics": "statistics",
    "forgetting_problem": "statistics",
    "minimum_detectable_drop": "statistics",
    "overlapping_questions": "statistics",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
