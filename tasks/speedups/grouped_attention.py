"""Grouped-query attention without copies while grpoflow decodes: the KV cache kept in autocast's dtype, and each
key/value head multiplied once by all the query heads that share it.

Grouped-query models (SmolLM2, Qwen2) keep fewer key/value heads than query heads. Eager attention repeats the
whole cache to every query head (``repeat_kv``), then autocast casts each copy to bf16 for the matrix products:
per layer and decoding step, four copies of the whole cache. At evaluation's sizes (80 rows, about 50 positions)
they took more time than the model's linear layers. Here the cache stores each new token once, already cast,
and ``grouped_attention`` stacks the query heads of a key/value head as rows of one product (the same dot
products, the same order of summation: checked below).

The attention function is registered under its own name (``AttentionInterface``, public) and switched on by
setting the model config's private ``_attn_implementation`` for the duration, hence this package.
``check_once`` compares both ways on the model at hand, to the bit, before the first use; a model this does not
fit (sliding-window layers, attention other than eager, heads that do not divide) keeps the stock path.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tasks.models.precision import autocast_dtype

logger = logging.getLogger(__name__)

GROUPED = "grpoflow_grouped"


def grouped_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (transformers' ``eager_attention_forward``, step for step) with the query heads of each
    key/value head as the rows of one product, instead of the keys and values repeated to every query head.

    >>> q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    >>> out, _ = grouped_attention(torch.nn.Module(), q, k, v, None, 0.5)
    >>> reference = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(2, 3) * 0.5, -1) @ v.repeat_interleave(2, 1)
    >>> torch.allclose(out, reference.transpose(1, 2), atol=1e-6)
    True
    """
    batch, heads, length, size = query.shape
    kv_heads = key.shape[1]
    stacked = query.reshape(batch, kv_heads, heads // kv_heads * length, size)
    weights = torch.matmul(stacked, key.transpose(2, 3)).view(batch, heads, length, -1) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights.reshape(batch, kv_heads, heads // kv_heads * length, -1), value)
    output = output.view(batch, heads, length, size).transpose(1, 2).contiguous()
    return output, weights


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, eager_mask)


class CastLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores keys and values in ``dtype`` (what autocast would cast them to at every
    product); None: as given."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cast_to = dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.cast_to is not None:
            key_states, value_states = key_states.to(self.cast_to), value_states.to(self.cast_to)
        return super().update(key_states, value_states)


def _attention_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]


def fits(model: Any) -> bool:
    """Whether ``model`` can decode this way: eager attention, key/value heads that divide the query heads, and a
    stock cache of plain ``DynamicLayer`` (no sliding windows)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "eager":
        return False
    text = config.get_text_config(decoder=True)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None) or 0
    if not heads or not kv_heads or heads % kv_heads or not _attention_modules(model):
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config this cache cannot read: the stock path
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@contextlib.contextmanager
def _grouped(model: Any) -> Iterator[None]:
    """``model`` attending with ``grouped_attention`` for the duration."""
    _register()
    configs = {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values()
    saved = [(config, config._attn_implementation) for config in configs]
    for config, _ in saved:
        config._attn_implementation = GROUPED
    try:
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation = implementation


def _new_cache(model: Any, dtype: torch.dtype | None) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    cache.layers = [CastLayer(dtype) for _ in cache.layers]
    return cache


@contextlib.contextmanager
def grouped_decoding(model: Any, device_type: str = "cpu") -> Iterator[Callable[[], DynamicCache] | None]:
    """For the duration, ``model`` attends with ``grouped_attention`` and this yields a factory of the caches it
    must decode with; or None where the model does not fit or the check failed: the stock path then."""
    if not fits(model) or not check_once(model, device_type):
        yield None
        return
    dtype = autocast_dtype(device_type)
    with _grouped(model):
        yield lambda: _new_cache(model, dtype)


_checked: dict[tuple, bool] = {}


def check_once(model: Any, device_type: str) -> bool:
    """Prefill two short prompts (one left-padded) and decode three tokens the stock way and this way, under the
    autocast in force: the logits must be equal to the bit. Checked once per model class, configuration and
    autocast dtype; a mismatch is logged and keeps the stock path."""
    key = (type(model).__name__, model.config.to_json_string(), autocast_dtype(device_type))
    if key not in _checked:
        _checked[key] = _agrees(model, device_type)
        if not _checked[key]:
            logger.info("grouped attention disagrees with eager attention on %s: the stock path is kept", key[0])
    return _checked[key]


def _agrees(model: Any, device_type: str) -> bool:
    from tasks.models import with_cache

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
                out = model(
                    input_ids=step,
                    attention_mask=attention,
                    position_ids=positions,
                    use_cache=True,
                    **with_cache(cache),
                ).logits[:, -1]
                logits.append(out.float())
                step = out.argmax(-1, keepdim=True)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
                positions = attention.sum(-1, keepdim=True) - 1
        return logits

    was_training = model.training
    model.eval()
    try:
        stock = run(DynamicCache(config=model.config))
        with _grouped(model):
            grouped = run(_new_cache(model, autocast_dtype(device_type)))
    except Exception as exc:  # noqa: BLE001 - any failure keeps the stock path
        logger.info("grouped attention unavailable (%s): the stock path is kept", exc)
        return False
    finally:
        model.train(was_training)
    return all(torch.equal(a, b) for a, b in zip(stock, grouped, strict=True))
