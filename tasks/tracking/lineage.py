"""Data lineage in MLflow: the validated train and hold-out splits as MLflow datasets on the pipeline's run and on
every stage's run, with grpoflow's own content fingerprint as the digest (MLflow's pandas digest hashes only the
first 10,000 rows and drops list columns) and the data source. grpoflow has no active fluent run, so everything
goes through the client (``MlflowClient.log_inputs``); ``mlflow.log_input`` would start a stray run.
Must not import: torch, transformers, a stage."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SPLIT_TAG = "grpoflow.split"
CONTEXT_TAG = "mlflow.data.context"  # MLflow's own tag: the UI shows it beside the dataset
CONTEXTS = {"train": "training", "holdout": "evaluation"}


@dataclass(frozen=True)
class DataSplit:
    """One validated split as MLflow records it.

    >>> DataSplit("train", "3f2a9c", "builtin:arithmetic", "/runs/r1/validate/train.jsonl", 960, ("id",)).context
    'training'
    """

    split: str  # "train" or "holdout"
    digest: str  # grpoflow's fingerprint of the split's rows (``tasks.inputs.fingerprint``)
    source: str  # the config's data.source
    file: str  # the split's JSONL file
    rows: int
    columns: tuple[str, ...] = ()

    @property
    def context(self) -> str:
        return CONTEXTS.get(self.split, self.split)


def validated_splits(result: Any, source: str) -> list[DataSplit]:
    """The two splits of a ``ValidateResult`` (none from a result pickled before splits had digests)."""
    if not getattr(result, "train_digest", ""):
        return []
    columns = tuple(getattr(result, "columns", ()))
    return [
        DataSplit("train", result.train_digest, source, str(result.train_path), result.rows_train, columns),
        DataSplit("holdout", result.holdout_digest, source, str(result.holdout_path), result.rows_holdout, columns),
    ]


def source_type(source: str) -> str:
    """MLflow's name for where a data source lives.

    >>> [source_type(s) for s in ("hub:openai/gsm8k@main", "builtin:arithmetic", "data/train.jsonl")]
    ['hugging_face', 'code', 'local']
    """
    if source.startswith("hub:"):
        return "hugging_face"
    return "code" if source.startswith("builtin:") else "local"


def dataset_input(split: DataSplit) -> Any:
    """The ``DatasetInput`` of one split: named by the split, digested by grpoflow, tagged with its context."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(
        name=split.split,
        digest=split.digest,
        source_type=source_type(split.source),
        source=json.dumps({"uri": split.source, "file": split.file}),
        profile=json.dumps({"num_rows": split.rows, "columns": list(split.columns)}),
    )
    return DatasetInput(dataset, tags=[InputTag(CONTEXT_TAG, split.context), InputTag(SPLIT_TAG, split.split)])


def logged_digests(client: Any, run_id: str) -> dict[str, str]:
    """``{split: digest}`` of the datasets a run lists.

    The run's own inputs, as MLflow returns them."""
    inputs = client.get_run(run_id).inputs
    return {item.dataset.name: item.dataset.digest for item in (inputs.dataset_inputs if inputs else [])}


def log_splits(client: Any, run_id: str, splits: Sequence[DataSplit]) -> int:
    """Log the splits a run does not list yet (a resumed run, a retried stage: no duplicates); how many."""
    present = logged_digests(client, run_id)
    missing = [split for split in splits if present.get(split.split) != split.digest]
    if missing:
        client.log_inputs(run_id, datasets=[dataset_input(split) for split in missing])
    return len(missing)


def copy_splits(client: Any, from_run_id: str, to_run_id: str) -> int:
    """List on ``to_run_id`` (a stage's run) the datasets ``from_run_id`` (the pipeline's run) lists; how many."""
    inputs = client.get_run(from_run_id).inputs
    datasets = list(inputs.dataset_inputs) if inputs else []
    if datasets:
        client.log_inputs(to_run_id, datasets=datasets)
    return len(datasets)
