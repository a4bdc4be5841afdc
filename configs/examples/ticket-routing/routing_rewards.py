"""A custom reward for the ticket-routing example: the team named in the answer against the ground truth, where
misrouting a high-priority ticket costs more. It reads ``priority``, a column of the example's own data: a reward
function receives every column of the validated row as a keyword argument, one value per completion.

>>> route_reward(["billing", "Team: technical", "account"], ground_truth=["billing"] * 3,
...              priority=["low", "high", "low"])
[1.0, -0.5, 0.0]
>>> route_reward(["I am not sure"], ground_truth=["billing"], priority=["low"])
[0.0]
"""

from __future__ import annotations

import re
from typing import Any

TEAMS = ("billing", "technical", "account")


def _text(completion: Any) -> str:
    """A completion as text: TRL passes plain strings, or chat messages for conversational data."""
    if isinstance(completion, list):
        return " ".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def named_team(text: str) -> str | None:
    """The one team a completion names, or None when it names none or several.

    >>> named_team("Route to: Billing."), named_team("billing or account?")
    ('billing', None)
    """
    found = {team for team in TEAMS if re.search(rf"\b{team}\b", text.lower())}
    return found.pop() if len(found) == 1 else None


def route_reward(completions: list[Any], ground_truth: list[str], priority: list[str], **kwargs: Any) -> list[float]:
    """1.0 for the right team; a wrong team costs 0.5 on a high-priority ticket, nothing on a low one; an answer
    that names no single team scores 0."""
    scores = []
    for completion, truth, urgent in zip(completions, ground_truth, priority, strict=True):
        team = named_team(_text(completion))
        if team == truth:
            scores.append(1.0)
        elif team is not None and urgent == "high":
            scores.append(-0.5)
        else:
            scores.append(0.0)
    return scores
