"""The difficulty filter on tool batches: TRL's ``tool_mask`` is one of the completion columns it merges and
selects, so the rounds it keeps still mask out exactly the tool answers' tokens (the filter used to switch itself
off for such batches)."""

from __future__ import annotations

import torch

from tasks.speedups.dynamic_sampling import _KNOWN_KEYS, concat_generation_outputs, loss_tokens, select_rows


def _round(completions: list[list[int]], tool: list[list[int]], advantage: float) -> dict:
    width = max(map(len, completions))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in completions])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in completions])
    tool_mask = torch.tensor([row + [1] * (width - len(row)) for row in tool])
    return {
        "prompt_ids": torch.tensor([[5, 6]] * len(completions)),
        "prompt_mask": torch.ones(len(completions), 2, dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": mask,
        "tool_mask": tool_mask,
        "advantages": torch.full((len(completions),), advantage),
    }


def test_rounds_with_tool_masks_merge_and_select_with_every_tool_token_still_masked() -> None:
    assert "tool_mask" in _KNOWN_KEYS
    first = _round([[1, 2, 3], [4]], [[1, 0, 1], [1]], 0.5)  # row 0: its middle token is a tool answer
    second = _round([[7, 8, 9, 10, 11]], [[1, 1, 0, 0, 1]], -0.5)
    merged = concat_generation_outputs([first, second], pad_id=0)
    assert merged["tool_mask"].tolist() == [[1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 1]]
    assert loss_tokens(merged).tolist() == [[1, 0, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 1]]
    kept = select_rows(merged, torch.tensor([0, 1]))  # the second round's row dropped: its padding columns go
    assert kept["completion_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert loss_tokens(kept).tolist() == [[1, 0, 1], [1, 0, 0]]
    assert int(loss_tokens(merged).sum()) == 2 + 1 + 3  # the tokens the model wrote, no more
