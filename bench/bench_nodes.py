"""GRPO on one process, two processes on one node, and two nodes (each a node agent in its own filesystem and PID
namespace on this host, meeting on loopback, an MLflow server between them): the median GRPO step, the stage's
wall time, and what one all-reduce of the adapter's gradients costs on that group (``allreduce_ms``, measured by
the ranks after training). The global batch is the same in every layout; ``speedups: off`` throughout (they switch
off above one process, so the single process would otherwise run a different trainer); each process gets an equal
share of the cores. The table goes to docs/operations.md ("Several nodes").

The two-node step is then split into compute, all-reduce and waiting: compute is the median step of one process
doing one node's share (half the global batch on half the cores), all-reduce is the measured all-reduce of the
adapter's gradients (one per optimizer step: gradient accumulation syncs only at its last micro-batch), and waiting
is the rest (ranks waiting for each other, the gathers of completions and rewards, the launch's share of the step).
For another network the all-reduce is estimated with the ring formula 2(n-1)/n x bytes / bandwidth + 2(n-1) x
latency, printed for 10 and 100 Gbit/s: an estimate, not a measurement.

With ``--namespaces`` (root) the two nodes run in network namespaces of their own on a bridge, as
``make test-nodes`` does, so the all-reduce crosses veth links rather than loopback.

Run: .venv/bin/python bench/bench_nodes.py [--model tiny|demo] [--steps N] [--layouts NAME ...] [--namespaces]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tasks.training.nodes.network import bridged_namespaces  # noqa: E402

# nodes, processes, and the share of the global batch and cores the whole layout gets
LAYOUTS = {
    "1 process": (1, 1, 1.0),
    "1 process, one node's share": (1, 1, 0.5),
    "2 processes, 1 node": (1, 2, 1.0),
    "2 nodes, 1 process each": (2, 1, 1.0),
}
TWO_NODES, ONE_SHARE = "2 nodes, 1 process each", "1 process, one node's share"


def mlflow_server(root: Path, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    from flows.services import free_port

    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "a")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # its GenAI job workers: not used
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    for _ in range(180):
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2):
                return server, f"http://{host}:{port}"
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("mlflow server did not start")


def measure(model: str, layout: str, steps: int, uri: str, output: Path, networks: Any = None) -> dict[str, float]:
    from flows.pipeline import pipeline
    from tasks.config import load_config
    from tasks.tracking import client_for

    nodes, processes, share = LAYOUTS[layout]
    config_file = "demo.yaml" if model == "demo" else "tiny.yaml"
    global_batch = int((16 if model == "demo" else 8) * share)
    cores = int((os.cpu_count() or 1) * share)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // (nodes * processes)))
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
    if share < 1:  # one node's completions, as whole groups: the same work per process as on two nodes
        overrides["grpo"]["num_generations"] = global_batch
    if networks is not None and nodes > 1:  # each node in a network namespace of its own, meeting over veth
        overrides["orchestration"].update(
            local_network_namespaces=networks.namespaces, rendezvous_host=networks.addresses[0]
        )
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
        "allreduce_bytes": grpo.data.metrics.get("allreduce_bytes", float("nan")),
    }


def ring_allreduce_ms(size_bytes: float, nodes: int, gbit_per_s: float, latency_us: float = 20.0) -> float:
    """The ring all-reduce estimate: each node sends and receives 2(n-1)/n of the buffer, in 2(n-1) hops.

    >>> round(ring_allreduce_ms(1.25e9, 2, 10.0), 1)  # 1.25 GB over 10 Gbit/s between two nodes
    1000.0
    """
    transfer_s = 2 * (nodes - 1) / nodes * size_bytes * 8 / (gbit_per_s * 1e9)
    return (transfer_s + 2 * (nodes - 1) * latency_us * 1e-6) * 1000


def breakdown(rows: dict[str, dict[str, float]]) -> list[str]:
    """The two-node step split into compute, all-reduce and waiting, as Markdown lines."""
    step, compute = rows[TWO_NODES]["step_s"], rows[ONE_SHARE]["step_s"]
    allreduce_s = rows[TWO_NODES]["allreduce_ms"] / 1000
    waiting = max(0.0, step - compute - allreduce_s)
    size = rows[TWO_NODES]["allreduce_bytes"]
    lines = ["| two-node step (s) | compute (s) | all-reduce (s) | waiting (s) | all-reduce size (bytes) |"]
    lines += [
        "|---:|---:|---:|---:|---:|",
        f"| {step:.3f} | {compute:.3f} | {allreduce_s:.4f} | {waiting:.3f} | {size:.0f} |",
    ]
    estimates = ", ".join(f"{rate:g} Gbit/s ≈ {ring_allreduce_ms(size, 2, rate):.3f} ms" for rate in (10.0, 100.0))
    lines.append(f"\nEstimate (ring all-reduce, 20 µs a hop), this all-reduce between two nodes on {estimates}.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--namespaces", action="store_true", help="two nodes in network namespaces on a bridge (veth; needs root)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    with contextlib.ExitStack() as stack:
        networks = stack.enter_context(bridged_namespaces(2, os.getpid() % 10000)) if args.namespaces else None
        server, uri = mlflow_server(root, networks.bridge_address if networks else "127.0.0.1")
        stack.callback(server.terminate)
        rows = {layout: measure(args.model, layout, args.steps, uri, root / "out", networks) for layout in args.layouts}
    where = "two nodes on veth (network namespaces on a bridge)" if args.namespaces else "nodes on loopback"
    print(f"\n{args.model} model, GRPO, {args.steps} steps, speedups off, {where}")
    print("| layout | median step (s) | GRPO stage wall (s) | all-reduce of the adapter's gradients (ms) |")
    print("|---|---:|---:|---:|")
    for layout, found in rows.items():
        print(f"| {layout} | {found['step_s']:.2f} | {found['stage_s']:.0f} | {found['allreduce_ms']:.2f} |")
    if TWO_NODES in rows and ONE_SHARE in rows:
        print("\n" + "\n".join(breakdown(rows)))


if __name__ == "__main__":
    main()
