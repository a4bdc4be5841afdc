"""Finished rows leave the decoding batch: once a quarter of a batch's rows have hit EOS, the rest go on in a
smaller batch (their KV cache rows selected with ``DynamicCache.batch_select_indices``), instead of every row
running to the longest completion.

Evaluation's answers end after about 8 tokens, but almost every batch of 80 holds one sample that runs to the
limit of 16, so without this every row ran 16 steps. A row's numbers must not depend on which other rows share
its batch, and on CPUs that holds for the batch sizes measured except one: a batch of a single row takes other
kernels (its logits differ in the last bits). So a batch never shrinks below ``MIN_ROWS`` rows (finished rows
fill it up), and ``check_once`` compares a smaller batch with the full one on the model at hand, to the bit,
before the first use; where they differ, no row leaves its batch.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from tasks.models.cache_keyword import with_cache
from tasks.models.precision import autocast_dtype

logger = logging.getLogger(__name__)

MIN_ROWS = 8  # a one-row batch takes other kernels; eight rows cost about what one does while decoding


def rows_to_keep(done: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor | None:
    """Indices of the batch rows to go on decoding, or None to keep the batch as it is: the unfinished rows once
    at least a quarter of the batch has finished (a smaller batch costs a copy of the cache), topped up with the
    first finished rows to ``min_rows``.

    >>> rows_to_keep(torch.tensor([True, False, True, True, False, False, False, False]), min_rows=2).tolist()
    [1, 4, 5, 6, 7]
    >>> rows_to_keep(torch.tensor([True, False, False, False, False, False, False, False]), min_rows=2) is None
    True
    >>> rows_to_keep(torch.tensor([True, True, True, False]), min_rows=2).tolist()
    [0, 3]
    >>> rows_to_keep(torch.tensor([True, True, False]), min_rows=3) is None
    True
    """
    rows, finished = done.numel(), int(done.sum())
    if finished * 4 < rows or rows <= min_rows:
        return None
    keep = ~done
    missing = min_rows - (rows - finished)
    if missing > 0:
        keep[done.nonzero().squeeze(-1)[:missing]] = True
    return None if bool(keep.all()) else keep.nonzero().squeeze(-1)


_checked: dict[tuple, bool] = {}


def check_once(model: Any, new_cache: Callable[[], DynamicCache] | None, device_type: str) -> bool:
    """Whether rows of ``model`` decode to the same bits in a batch of ``MIN_ROWS`` as in a larger one, with the
    cache ``new_cache`` makes (a stock ``DynamicCache`` when None), under the autocast in force and with the
    model's layers as they are now (packed, with adapters). Checked once per such combination; a mismatch is
    logged and keeps whole batches."""
    layers = tuple(sorted({type(module).__name__ for module in model.modules()}))
    key = (type(model).__name__, model.config.to_json_string(), autocast_dtype(device_type), layers, new_cache is None)
    if key not in _checked:
        _checked[key] = _agrees(model, new_cache)
        if not _checked[key]:
            logger.info("rows decode differently in smaller batches on %s: whole batches are kept", key[0])
    return _checked[key]


def _agrees(model: Any, new_cache: Callable[[], DynamicCache] | None) -> bool:
    """Prefill 2 × ``MIN_ROWS`` short prompts (some left-padded), decode two tokens for all of them, and again
    with only ``MIN_ROWS`` of them after the first: the second token's logits must be equal to the bit."""
    device = next(model.parameters()).device
    rows = 2 * MIN_ROWS
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (rows, 7), generator=generator).to(device)
    mask = torch.ones_like(ids)
    for row in range(0, rows, 3):
        mask[row, : row % 5] = 0  # left padding, as sampling pads
    keep = torch.arange(1, rows, 2, device=device)

    def second_step(select: torch.Tensor | None) -> torch.Tensor:
        cache = DynamicCache(config=model.config) if new_cache is None else new_cache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **with_cache(cache)
        ).logits[:, -1]
        token, attention = first.argmax(-1, keepdim=True), mask
        if select is not None:
            cache.batch_select_indices(select)
            token, attention = token[select], attention[select]
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        positions = attention.sum(-1, keepdim=True) - 1
        return (
            model(
                input_ids=token, attention_mask=attention, position_ids=positions, use_cache=True, **with_cache(cache)
            )
            .logits[:, -1]
            .float()
        )

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            whole, part = second_step(None)[keep], second_step(keep)
    except Exception as exc:  # noqa: BLE001 - any failure keeps whole batches
        logger.info("smaller decoding batches unavailable (%s): whole batches are kept", exc)
        return False
    finally:
        model.train(was_training)
    return torch.equal(whole, part)
