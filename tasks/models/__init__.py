"""The policy: model sources (packaged SmolLM2, folders, Hub ids, the tiny test model), loading base models and
adapters, precision, and generation: one component (``sampling.PolicySampler``) with two engines, transformers
(grpoflow's loop or transformers' ``generate``) and vLLM (in this process or a server's).
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
    "with_cache": "cache_keyword",
    "export_merged": "loading",
    "load_base_model": "loading",
    "load_policy": "loading",
    "KeptBase": "loading",
    "load_tokenizer": "loading",
    "attention_implementation": "precision",
    "compute_autocast": "precision",
    "resolve_dtype": "precision",
    "merge_is_exact": "precision",
    "ModelSourceError": "sources",
    "SMOLLM2": "sources",
    "TINY_RANDOM": "sources",
    "TINY_RANDOM_VLLM": "sources",
    "TINY_RANDOM_TOOLS": "sources",
    "TINY_RANDOM_VLLM_TOOLS": "sources",
    "TINY_MODELS": "sources",
    "cache_dir": "sources",
    "prepare_in_background": "sources",
    "resolve_model_source": "sources",
    "EngineSpec": "vllm_engine",
    "rank_engine": "vllm_engine",
    "rank_seed": "vllm_engine",
    "VllmSampler": "vllm_engine",
    "adapter_digest": "vllm_engine",
    "adapter_request": "vllm_engine",
    "close_engine": "vllm_engine",
    "engine_spec": "vllm_engine",
    "shared_engine": "vllm_engine",
    "vllm_installed": "vllm_engine",
    "ServerSampler": "vllm_server",
    "VllmServerClient": "vllm_server",
    "VllmServerAuthError": "vllm_server",
    "VllmServerUnavailable": "vllm_server",
    "server_command": "vllm_server",
    "PolicySampler": "sampling",
    "TransformersSampler": "sampling",
    "pipeline_backend": "sampling",
    "pipeline_engine": "sampling",
    "engine_name": "sampling",
    "pipeline_engine_spec": "sampling",
    "pipeline_server_command": "sampling",
    "policy_sampler": "sampling",
    "engine_sampler": "sampling",
    "Conversation": "tool_rollouts",
    "ToolPrompt": "tool_rollouts",
    "ToolSampler": "tool_rollouts",
    "generate_completion_ids": "generation",
    "resolve_backend": "sampling",
    "samples_on_cpu": "sampling",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
