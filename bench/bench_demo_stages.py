"""Stage time and peak memory of the last completed `make demo` run, stage by stage, read from its MLflow runs
(nothing is rerun). Run: .venv/bin/python bench/bench_demo_stages.py [--config configs/demo.yaml]
"""

from __future__ import annotations

import argparse
import json
import sys

from tasks.config import load_config
from tasks.tracking import RUN_ID_TAG, STAGE_TAG, client_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/demo.yaml")
    config = load_config(parser.parse_args().config)
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    if experiment is None:
        print(json.dumps({"bench": "demo_stages", "error": f"no MLflow experiment under {config.output_dir}"}))
        sys.exit(0)
    parents = client.search_runs(
        [experiment.experiment_id],
        f"attributes.status = 'FINISHED' and tags.`grpoflow.name` = '{config.name}'",
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    parents = [run for run in parents if "mlflow.parentRunId" not in run.data.tags]
    if not parents:
        print(json.dumps({"bench": "demo_stages", "error": "no completed demo run yet: run `make demo` first"}))
        sys.exit(0)
    parent = parents[0]
    stages = client.search_runs(
        [experiment.experiment_id],
        f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
    )
    rows = [
        {
            "stage": run.data.tags.get(STAGE_TAG),
            "seconds": round(run.data.metrics.get("stage_seconds", 0.0), 1),
            "peak_rss_mb": round(run.data.metrics.get("peak_rss_mb", 0.0)),
        }
        for run in stages
    ]
    total = round((parent.info.end_time - parent.info.start_time) / 1000, 1)
    print(
        json.dumps(
            {
                "bench": "demo_stages",
                "run_id": parent.data.tags.get(RUN_ID_TAG),
                "stages": rows,
                "pipeline_seconds": total,
            }
        )
    )
    print(f"run {parent.data.tags.get(RUN_ID_TAG)}: {total} s")
    print(f"{'stage':12}{'seconds':>10}{'peak RSS MB':>13}")
    for row in rows:
        print(f"{row['stage']:12}{row['seconds']:>10}{row['peak_rss_mb']:>13}")


if __name__ == "__main__":
    main()
