"""The MLflow Model Registry: versions and alias lookups, the champion's history and moves, pins, the
promotion lock, migrating old versions, what a version holds (packaging, model card) and its pyfunc loader.
Must not import: torch, transformers, Prefect (``grpoflow rollback`` loads only this), a stage.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "MOVE_TAG_PREFIX": "champions",
    "apply_promotion": "champions",
    "champion_moves": "champions",
    "champion_stack": "champions",
    "default_actor": "champions",
    "move_champion": "champions",
    "reconcile": "champions",
    "rollback_champion": "champions",
    "timestamp": "champions",
    "version_rows": "champions",
    "promotion_lock": "locks",
    "migrate_versions": "migrate",
    "short_description": "model_card",
    "version_card": "model_card",
    "base_fingerprint": "packaging",
    "check_base_fingerprint": "packaging",
    "save_version_model": "packaging",
    "PIN_TAG": "pins",
    "pin_champion": "pins",
    "pinned_version": "pins",
    "unpin_champion": "pins",
    "CHALLENGER": "versions",
    "CHAMPION": "versions",
    "HISTORY_TAG": "versions",
    "ModelNotFound": "versions",
    "RegistryError": "versions",
    "alias_version": "versions",
    "alias_version_number": "versions",
    "client_for": "versions",
    "fetch_adapter": "versions",
    "parse_model_uri": "versions",
    "register_adapter": "versions",
    "registered_model": "versions",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
