"""A KV cache that holds keys and values the way eager attention consumes them: repeated to every query head and
already in autocast's dtype. Grouped-query models (SmolLM2, Qwen2) keep fewer key/value heads than query heads,
and eager attention repeats the whole cache to every query head (``repeat_kv``), then autocast casts the copy to
bf16 for the matrix product: per layer, per decoding step, four copies of the whole cache. At evaluation's sizes
(80 rows, about 50 positions) those copies took more time than the model's linear layers.

Here each step repeats and casts only its new token, and the attention modules are told not to repeat
(``num_key_value_groups`` set to 1 for the duration: a PEFT-free, private use of transformers' attention
modules, hence this package). The values and layouts attention sees are those it saw before, so outputs are the
same to the bit; ``check_once`` compares both ways on the model at hand before the first use, and any model this
does not fit (sliding-window layers, attention other than eager, uneven head groups) keeps the stock cache.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

logger = logging.getLogger(__name__)


def _repeated(states: torch.Tensor, groups: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``states`` (batch, kv heads, positions, head dim) cast to ``dtype`` and repeated ``groups`` times per head,
    as ``repeat_kv`` lays them out (each kv head's copies side by side).

    >>> _repeated(torch.arange(4.0).view(1, 2, 2, 1), 2, torch.bfloat16).flatten().tolist()
    [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    """
    if dtype is not None and states.dtype != dtype:
        states = states.to(dtype)
    if groups == 1:
        return states
    batch, heads, positions, size = states.shape
    expanded = states[:, :, None].expand(batch, heads, groups, positions, size)
    return expanded.reshape(batch, heads * groups, positions, size)


class RepeatedLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores keys and values repeated to the query heads, in ``dtype`` (None: as given)."""

    def __init__(self, groups: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.groups, self.cast_to = groups, dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().update(
            _repeated(key_states, self.groups, self.cast_to), _repeated(value_states, self.groups, self.cast_to)
        )


def _attention_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]


def fits(model: Any) -> bool:
    """Whether ``model`` can decode with ``RepeatedLayer``: eager attention, one head-group size for every layer,
    and a stock cache of plain ``DynamicLayer`` (no sliding windows)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "eager":
        return False
    modules = _attention_modules(model)
    if not modules or len({m.num_key_value_groups for m in modules}) != 1:
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config this cache cannot read: the stock path
        return False
    return len(layers) == len(modules) and all(type(layer) is DynamicLayer for layer in layers)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on ``device_type`` right now (None when it is off)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@contextlib.contextmanager
def repeated_kv(model: Any, device_type: str = "cpu") -> Iterator[Callable[[], DynamicCache] | None]:
    """For the duration, a factory of repeated-KV caches for ``model`` (which then must decode with one of them),
    or None where the model does not fit or the check failed: use the stock cache then."""
    if not fits(model) or not check_once(model, device_type):
        yield None
        return
    modules = _attention_modules(model)
    groups = modules[0].num_key_value_groups
    dtype = autocast_dtype(device_type)

    def new_cache() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        cache.layers = [RepeatedLayer(groups, dtype) for _ in cache.layers]
        return cache

    for module in modules:
        module.num_key_value_groups = 1
    try:
        yield new_cache
    finally:
        for module in modules:
            module.num_key_value_groups = groups


_checked: dict[tuple, bool] = {}


def check_once(model: Any, device_type: str) -> bool:
    """Prefill two short prompts and decode three tokens with the stock cache and with the repeated one, under
    the autocast in force: the logits must be equal to the bit. Checked once per model class, configuration
    and autocast dtype; a mismatch is logged and keeps the stock cache."""
    key = (type(model).__name__, model.config.to_json_string(), autocast_dtype(device_type))
    if key not in _checked:
        _checked[key] = _agrees(model, device_type)
        if not _checked[key]:
            logger.warning("repeated KV cache disagrees with the stock cache on %s: stock cache kept", key[0])
    return _checked[key]


def _agrees(model: Any, device_type: str) -> bool:
    from tasks.models.generation import with_cache

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (2, 7), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as sampling pads

    def run(cache: DynamicCache) -> list[torch.Tensor]:
        logits, attention, step = [], mask, ids
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            for _ in range(4):
                out = model(input_ids=step, attention_mask=attention, position_ids=positions, use_cache=True,
                            **with_cache(cache)).logits[:, -1]  # fmt: skip
                logits.append(out.float())
                step = out.argmax(-1, keepdim=True)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
                positions = attention.sum(-1, keepdim=True) - 1
        return logits

    was_training = model.training
    model.eval()
    try:
        stock = run(DynamicCache(config=model.config))
        modules = _attention_modules(model)
        groups = modules[0].num_key_value_groups
        cache = DynamicCache(config=model.config)
        cache.layers = [RepeatedLayer(groups, autocast_dtype(device_type)) for _ in cache.layers]
        for module in modules:
            module.num_key_value_groups = 1
        try:
            repeated = run(cache)
        finally:
            for module in modules:
                module.num_key_value_groups = groups
    except Exception as exc:  # noqa: BLE001 - any failure keeps the stock cache
        logger.info("repeated KV cache unavailable (%s): stock cache kept", exc)
        return False
    finally:
        model.train(was_training)
    return all(torch.equal(a, b) for a, b in zip(stock, repeated, strict=True))
