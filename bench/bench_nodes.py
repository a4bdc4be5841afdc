"""GRPO on one process, two processes on one node, and two nodes (each a node agent in its own filesystem and PID
namespace on this host, meeting on loopback, an MLflow server between them): the median GRPO step, the stage's
wall time, and what one all-reduce of the adapter's gradients costs on that group (``allreduce_ms``, measured by
the ranks after training). The global batch is the same in every layout; ``speedups: off`` throughout (they switch
off above one process, so the single process would otherwise run a different trainer); each process gets an equal
share of the cores. The table goes to docs/operations.md ("Several nodes").

Run: .venv/bin/python bench/bench_nodes.py [--model tiny|demo] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"1 process": (1, 1), "2 processes, 1 node": (1, 2), "2 nodes, 1 process each": (2, 1)}


def mlflow_server(root: Path) -> tuple[subprocess.Popen, str]:
    from flows.services import free_port

    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "a")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # its GenAI job workers: not used
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    for _ in range(180):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("mlflow server did not start")


def measure(model: str, layout: str, steps: int, uri: str, output: Path) -> dict[str, float]:
    from flows.pipeline import pipeline
    from tasks.config import load_config
    from tasks.tracking import client_for

    nodes, processes = LAYOUTS[layout]
    config_file = "demo.yaml" if model == "demo" else "tiny.yaml"
    global_batch = 16 if model == "demo" else 8
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (nodes * processes)))
    overrides = {
        "output_dir": str(output),
        "sft": {"enabled": False, "speedups": "off"},
        "probe": {"enabled": False},
        "canaries": {"enabled": False},
        "grpo": {"max_steps": steps, "batch_size": global_batch // (nodes * processes), "speedups": "off"},
        "evaluation": {"num_prompts": 4, "n_samples": 1, "k": [1], "forgetting": False},
        "orchestration": {"nodes": nodes, "num_processes": processes, "rendezvous_port": 29451},
        "tracking": {"tracking_uri": uri, "registered_model_name": f"bench-nodes-{model}"},
    }
    config = load_config(REPO / "configs" / config_file, overrides)
    run_id = f"{model}-{nodes}x{processes}-{int(time.time())}"
    pipeline(config, run_id)
    client = client_for(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.grpoflow.run_id = '{run_id}'")
    grpo = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo")
    stamps = sorted((m.step, m.timestamp) for m in client.get_metric_history(grpo.info.run_id, "loss"))
    gaps = [(b[1] - a[1]) / 1000 for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "step_s": statistics.median(gaps) if gaps else float("nan"),
        "stage_s": grpo.data.metrics.get("stage_seconds", float("nan")),
        "allreduce_ms": grpo.data.metrics.get("allreduce_ms", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    server, uri = mlflow_server(root)
    try:
        rows = [(layout, measure(args.model, layout, args.steps, uri, root / "out")) for layout in LAYOUTS]
    finally:
        server.terminate()
    print(f"\n{args.model} model, GRPO, {args.steps} steps, global batch the same in every layout, speedups off")
    print("| layout | median step (s) | GRPO stage wall (s) | all-reduce of the adapter's gradients (ms) |")
    print("|---|---:|---:|---:|")
    for layout, found in rows:
        print(f"| {layout} | {found['step_s']:.2f} | {found['stage_s']:.0f} | {found['allreduce_ms']:.2f} |")


if __name__ == "__main__":
    main()
