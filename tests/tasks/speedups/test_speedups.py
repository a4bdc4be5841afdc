"""The speed-ups' one switch: ``auto`` runs them only on the releases they were checked on."""

from __future__ import annotations

import logging

import pytest

import tasks.grpo.stage  # noqa: F401  (imports Prefect now: its logging set-up must not replace caplog's handler later)
import tasks.speedups as speedups
from tasks.training import grpo_trainer_class


def test_the_lock_is_inside_every_checked_range() -> None:
    """The installed (locked) versions are ones the speed-ups were checked on, so ``auto`` turns them on."""
    speedups._installed_outside_checked.cache_clear()
    assert speedups._installed_outside_checked() == ()
    assert speedups.speedups_on("auto") and not speedups.speedups_on("off")


def test_an_unchecked_release_turns_them_off_with_one_log_line(monkeypatch, caplog) -> None:
    """A TRL the speed-ups were not checked on: stock trainers and generation, said once in the log."""
    monkeypatch.setitem(speedups.CHECKED_ON, "trl", ("0.1", "0.2"))
    speedups._installed_outside_checked.cache_clear()
    grpo_trainer_class.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tasks.speedups"):
            assert not speedups.speedups_on("auto") and not speedups.speedups_on("auto")
            assert grpo_trainer_class("auto").__name__ == "StockGRPOTrainer"
        lines = [r.getMessage() for r in caplog.records if r.name == "tasks.speedups"]
        assert len(lines) == 1 and "trl 1.16" in lines[0] and "checked on >=0.1,<0.2" in lines[0]
    finally:
        speedups._installed_outside_checked.cache_clear()
        grpo_trainer_class.cache_clear()


@pytest.mark.parametrize(
    ("installed", "outside"),
    [
        ({"torch": "2.13.0", "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2"}, []),
        ({"torch": "2.14.0", "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2"}, ["torch"]),
        ({"torch": "2.13.0", "transformers": "5.16.1", "trl": "1.17.0", "peft": "0.21.2"}, ["transformers", "trl"]),
        ({"torch": "2.13.0", "transformers": "5.17.0", "trl": "1.16.0"}, ["peft"]),
    ],
)
def test_outside_checked_names_each_package_out_of_range(installed, outside) -> None:
    assert [line.split()[0] for line in speedups.outside_checked(installed)] == outside


def test_rows_sharing_a_prompt_sum_their_gradients_in_a_fixed_order() -> None:
    """The shared-prefill loss selects each row's prompt from the cache; the backward sums the rows' gradients
    into the prompt. Advanced indexing summed them in thread order (4-7 different gradients in 30 identical
    calls at this size), so the same seed trained different adapters; ``select_cache_rows`` sums in one order."""
    import hashlib

    import torch
    from transformers import DynamicCache

    from tasks.speedups.grpo_trainer import select_cache_rows

    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 9, 64, 576, generator=generator) for _ in range(2))  # two distinct prompts
    of_row = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1] * 2)
    upstream = torch.randn(16, 9, 64, 576, generator=generator)
    seen = set()
    for _ in range(12):
        leaf_keys, leaf_values = keys.clone().requires_grad_(True), values.clone().requires_grad_(True)
        cache = DynamicCache()
        cache.update(leaf_keys, leaf_values, 0)
        select_cache_rows(cache, of_row)
        assert torch.equal(cache.layers[0].keys, keys[of_row])  # the rows batch_select_indices would keep
        ((cache.layers[0].keys + cache.layers[0].values) * upstream).sum().backward()
        seen.add(hashlib.sha256(leaf_keys.grad.numpy().tobytes() + leaf_values.grad.numpy().tobytes()).hexdigest())
    assert len(seen) == 1
    expected = torch.stack([upstream[of_row == prompt].sum(0) for prompt in (0, 1)])
    torch.testing.assert_close(leaf_keys.grad, expected)
