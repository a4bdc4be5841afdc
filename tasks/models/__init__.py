"""The policy: model sources (packaged SmolLM2, folders, Hub ids, the tiny test model), loading base models and
adapters, precision, and generation (one component: grpoflow's transformers loop or transformers' ``generate``).
Must not import: Prefect, MLflow, a stage.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "GenerationStats": "generation",
    "generate_completions": "generation",
    "sample_groups": "generation",
    "shared_prefill": "generation",
    "with_cache": "generation",
    "export_merged": "loading",
    "load_base_model": "loading",
    "load_policy": "loading",
    "load_tokenizer": "loading",
    "attention_implementation": "precision",
    "compute_autocast": "precision",
    "resolve_dtype": "precision",
    "ModelSourceError": "sources",
    "SMOLLM2": "sources",
    "TINY_RANDOM": "sources",
    "cache_dir": "sources",
    "resolve_model_source": "sources",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
