"""The Great Expectations suite over the kept rows: run through a checkpoint that also builds Data Docs; returns
the failing row ids with the expectation names.

Must not import: Prefect, MLflow, torch, transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import DataSettings
from tasks.inputs.rows import prompt_text


def gx_audit(
    kept: list[dict[str, Any]], settings: DataSettings, docs_dir: Path | None = None, texts: list[str] | None = None
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Run the Great Expectations suite over the kept rows through a checkpoint (which builds Data Docs into
    ``docs_dir`` when given); returns the failing ids with expectation names, and a summary."""
    import great_expectations as gx
    import pandas as pd

    frame = pd.DataFrame(
        {
            "id": [row["id"] for row in kept],
            "prompt_text": texts if texts is not None else [prompt_text(row["prompt"]) for row in kept],
            "ground_truth": [row["ground_truth"] for row in kept],
        }
    )
    frame["prompt_chars"] = frame["prompt_text"].str.len()
    context = gx.get_context(mode="ephemeral")
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # one progress display: grpoflow's
    actions = []
    if docs_dir is not None:
        context.add_data_docs_site(
            site_name="grpoflow",
            site_config={
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(docs_dir.resolve()),  # GX wants an absolute path
                },
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
        actions.append(gx.checkpoint.UpdateDataDocsAction(name="data-docs", site_names=["grpoflow"]))
    batch_definition = (
        context.data_sources.add_pandas("grpoflow")
        .add_dataframe_asset("rows")
        .add_batch_definition_whole_dataframe("all")
    )
    expectations = [
        *(gx.expectations.ExpectColumnToExist(column=c) for c in ("id", "prompt_text", "ground_truth")),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="id"),
        gx.expectations.ExpectColumnValuesToBeUnique(column="id"),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="prompt_text"),
        gx.expectations.ExpectColumnValuesToMatchRegex(column="prompt_text", regex=r"\S"),
        gx.expectations.ExpectColumnValuesToBeBetween(
            column="prompt_chars", min_value=settings.min_prompt_chars, max_value=settings.max_prompt_chars
        ),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="ground_truth"),
        gx.expectations.ExpectColumnValuesToMatchRegex(column="ground_truth", regex=r"\S"),
    ]
    if settings.kind == "label" and settings.labels:  # rows may instead carry their own 'labels'
        expectations.append(
            gx.expectations.ExpectColumnValuesToBeInSet(column="ground_truth", value_set=settings.labels)
        )
    suite = context.suites.add(gx.ExpectationSuite(name="grpoflow-rows", expectations=expectations))
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="grpoflow-rows", data=batch_definition, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="grpoflow-validate",
            validation_definitions=[definition],
            actions=actions,
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["id"]},
        )
    )
    result = next(iter(checkpoint.run(batch_parameters={"dataframe": frame}).run_results.values()))
    failing: dict[str, list[str]] = {}
    for outcome in result.results:
        if outcome.success:
            continue
        name = f"{outcome.expectation_config.type}({outcome.expectation_config.kwargs.get('column')})"
        for index in outcome.result.get("unexpected_index_list") or []:
            row_id = index["id"] if isinstance(index, dict) else kept[index]["id"]
            failing.setdefault(str(row_id), []).append(f"great_expectations: {name} failed")
    summary = {"success": bool(result.success), "statistics": dict(result.statistics)}
    return failing, summary
