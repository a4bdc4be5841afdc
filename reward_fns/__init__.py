"""Reward functions in TRL's contract: ``f(completions, **columns) -> list[float | None]``.

They score text only: no Prefect, MLflow or model code lives here.
Must not import: Prefect, MLflow, torch, ``tasks`` (reward functions score text).
"""
