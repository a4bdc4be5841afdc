"""Serving the registry: ``grpoflow serve`` answers OpenAI-compatible requests with the version an alias points at,
and follows the alias as it moves (records and checks: ``records.py``; engines: ``engines.py``; following the
alias: ``follower.py``; the HTTP front: ``app.py``; put together: ``server.py``).
Must not import: Prefect, a stage; torch and transformers only inside the engines.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "build_app": "app",
    "Completion": "engines",
    "EngineError": "engines",
    "TransformersEngine": "engines",
    "VllmEngine": "engines",
    "start_engine": "engines",
    "AliasFollower": "follower",
    "REFUSED_TAG": "follower",
    "UNCHECKED_TAG": "follower",
    "ServedVersion": "follower",
    "ServingMetrics": "metrics",
    "DIGEST_TAG": "records",
    "SMOKE_FILE": "records",
    "SmokeRecord": "records",
    "adapter_digest": "records",
    "read_smoke_record": "records",
    "smoke_verdict": "records",
    "write_smoke_record": "records",
    "random_adapter": "register",
    "register_served_version": "register",
    "record_smoke": "smoke",
    "smoke_messages": "smoke",
    "api_key_from": "server",
    "check_listening": "server",
    "serve": "server",
    "serving_target": "server",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
