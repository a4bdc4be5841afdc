"""Tools and environments: what the model may call while it answers. The built-in ``python`` tool (the code reward's
sandbox), a user's functions and environment classes, put together as one environment class per pipeline (TRL's
``environment_factory``: an instance per rollout, with its limits and its call records), the chat template that
renders tool turns, the tools' canaries and the tool traces SFT learns from. A tool knows no pipeline: it runs the
same in a trainer, a probe or a test.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "ToolCanaryFailed": "checks",
    "ToolLengthError": "checks",
    "ToolSizes": "checks",
    "measure_tools": "checks",
    "tool_canaries": "checks",
    "unknown_tool_reason": "checks",
    "CHATML": "chat_template",
    "ChatTemplateError": "chat_template",
    "TINY": "chat_template",
    "ToolTemplate": "chat_template",
    "grpoflow_template": "chat_template",
    "prepare_tokenizer": "chat_template",
    "response_template": "chat_template",
    "tool_suffix_ids": "chat_template",
    "turn_format_of": "chat_template",
    "PythonAnswer": "python_tool",
    "PythonLimits": "python_tool",
    "SandboxUnavailable": "python_tool",
    "run_python": "python_tool",
    "arithmetic_traces": "traces",
    "dataset_message": "traces",
    "tool_sft_examples": "traces",
    "RolloutTools": "toolbox",
    "ToolError": "toolbox",
    "ToolLimitReached": "toolbox",
    "ToolRecord": "toolbox",
    "ToolTimeout": "toolbox",
    "Toolbox": "toolbox",
    "error_answer": "toolbox",
    "pipeline_tools": "toolbox",
    "record_json": "toolbox",
    "tool_methods": "toolbox",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
