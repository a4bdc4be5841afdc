"""Stage 4, grpo: TRL ``GRPOTrainer`` continues training the SFT stage's LoRA adapter with the configured reward
functions. Split by job: ``stage`` composes the trainer and wraps it as the stage's Prefect task, ``reports`` writes
the stage run's tags and reports, ``deployment`` runs GRPO as its own Prefect deployment (a GPU work pool).

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
Must not import: another stage's module; Prefect and MLflow appear only in the task wrappers.
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "grpo_examples": "stage",
    "grpo_task": "stage",
    "run_grpo": "stage",
    "report_selection": "reports",
    "report_stop": "reports",
    "tool_tags": "reports",
    "grpo_task_for": "deployment",
    "remote_grpo_task": "deployment",
}

__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
