"""The one configuration model every stage reads (``PipelineConfig``; the only place defaults live) and its
loading: YAML, ``--set`` overrides, paths anchored to the config's folder, custom reward imports.
Must not import: torch, transformers, Prefect, MLflow.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "ConfigError": "loading",
    "anchor_paths": "loading",
    "import_rewards": "loading",
    "load_config": "loading",
    "PipelineConfig": "pipeline",
    "GRPOLossSettings": "grpo_loss",
    "changed_settings": "grpo_loss",
    "grpo_loss_args": "grpo_loss",
    "ArithmeticSettings": "settings",
    "CanarySettings": "settings",
    "DataSettings": "settings",
    "DynamicSamplingSettings": "settings",
    "EvaluationSettings": "settings",
    "GRPOSettings": "settings",
    "GenerationSettings": "settings",
    "LoraSettings": "settings",
    "ModelSettings": "settings",
    "OrchestrationSettings": "operations",
    "Precision": "settings",
    "ProbeSettings": "settings",
    "PromotionSettings": "settings",
    "RewardSpec": "settings",
    "SFTSettings": "settings",
    "ServingSettings": "operations",
    "SignalStopSettings": "settings",
    "Speedups": "settings",
    "TaskKind": "settings",
    "TrackingSettings": "operations",
    "WatchSettings": "operations",
    "PYTHON_TOOL": "tools",
    "ToolCanary": "tools",
    "ToolSettings": "tools",
    "ToolSpec": "tools",
    "import_object": "loading",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
