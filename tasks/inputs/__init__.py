"""What goes in: data loading (JSONL, CSV, Parquet, ``datasets`` folders, Hub ids, built-in sets), prompt
rendering, the row rules that normalise ``ground_truth`` and quarantine bad rows, and the Great Expectations suite.
Must not import: Prefect, MLflow, torch.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "gx_audit": "expectations",
    "DataSourceError": "loading",
    "answer_completion": "loading",
    "solution_completion": "loading",
    "SOLUTION": "loading",
    "arithmetic_rows": "loading",
    "load_rows": "loading",
    "read_jsonl": "loading",
    "render_prompt": "loading",
    "prompt_messages": "loading",
    "write_jsonl": "loading",
    "RowProblem": "rows",
    "check_row": "rows",
    "fingerprint": "rows",
    "holdout_side": "rows",
    "normalize_math": "rows",
    "prompt_text": "rows",
    "trace_tools": "rows",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
