"""The keyword a transformers model call takes its KV cache by, which transformers renamed.
Must not import: Prefect, MLflow, the stages, other project modules (generation and the speed-ups both use it).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def cache_argument() -> str:
    """The keyword that hands a transformers model its KV cache: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (5.24 still takes the old name, with a deprecation warning).

    >>> cache_argument() in ("cache", "past_key_values")
    True
    """
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """``{cache_argument(): cache}``: the model call's cache keyword for this transformers."""
    return {cache_argument(): cache}
