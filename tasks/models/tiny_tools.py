"""The tiny test model that calls the python tool: grpoflow's tiny random model fully fine-tuned, briefly, on tool
traces of the built-in multiplication task in grpoflow's tool template, so a test pipeline's rollouts hold real tool
calls (a random model never writes one, and LoRA SFT from random weights does not learn). Not for quality: it
writes well-formed calls, its digits are often wrong.

Every trace shares one long prefix (the system turn with the tool's schema, spelled out character by character):
it is encoded once per step without gradient and each trace's own tokens train on top of its KV cache, at their
true positions (about a quarter of the work of whole traces; windows without the prefix did not learn the turns).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import random
from pathlib import Path

STEPS = 90
BATCH = 16
LEARNING_RATE = 3e-3


def build_tiny_tool_caller(destination: Path, base: Path, seed: int = 0) -> None:
    """Train a copy of the tiny model at ``base`` on python-tool traces and save it (with the base's tokenizer,
    whose own template grpoflow's tool template replaces at run time) to ``destination``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from tasks.config import ArithmeticSettings, ToolSettings
    from tasks.environments import Toolbox, prepare_tokenizer, tool_methods
    from tasks.environments.traces import arithmetic_traces
    from tasks.inputs import answer_completion, arithmetic_rows

    tokenizer = AutoTokenizer.from_pretrained(base)
    saved_template = tokenizer.chat_template
    prepare_tokenizer(tokenizer, "grpoflow", "the tiny model")
    toolbox = Toolbox(ToolSettings(use=[{"name": "python"}]))
    tools = tool_methods(toolbox.factory())
    rows = arithmetic_rows(ArithmeticSettings(num_rows=256, operators=["*"]), seed)
    traces = arithmetic_traces(
        toolbox, [r["prompt"] for r in rows], [answer_completion("math", r["ground_truth"]) for r in rows]
    )
    encoded = []
    for row, trace in zip(rows, traces, strict=True):
        if trace is None:  # its call failed: no trace to learn from
            continue
        out = tokenizer.apply_chat_template(
            row["prompt"] + trace, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        encoded.append((out["input_ids"], out["assistant_masks"]))
    shared = min(_common_prefix(a, b) for (a, _), (b, _) in zip(encoded, encoded[1:], strict=False))
    prefix = torch.tensor([encoded[0][0][:shared]])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    pad = tokenizer.pad_token_id
    for step in range(STEPS):
        batch = [(ids[shared:], mask[shared:]) for ids, mask in random.Random(seed + step).sample(encoded, BATCH)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((BATCH, width), pad)
        labels = torch.full((BATCH, width), -100)
        attention = torch.zeros((BATCH, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            tokens = torch.tensor(ids)
            input_ids[row, : len(ids)], attention[row, : len(ids)] = tokens, 1
            labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, tokens, torch.tensor(-100))
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=prefix, past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(BATCH)
        logits = model(
            input_ids=input_ids,
            attention_mask=torch.cat([torch.ones(BATCH, shared, dtype=torch.long), attention], dim=1),
            position_ids=(shared + torch.arange(width)).expand(BATCH, -1),
            past_key_values=cache,
            use_cache=True,
        ).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(destination)
    tokenizer.chat_template = saved_template
    tokenizer.response_template = None
    tokenizer.save_pretrained(destination)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share.

    >>> _common_prefix([1, 2, 3], [1, 2, 4])
    2
    """
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
