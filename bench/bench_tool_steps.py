"""GRPO's step time with the python tool beside the same task without it: the tools demo's setting
(configs/tools-demo.yaml: SmolLM2, 3-digit products), each arm after its own short SFT (tool traces with the tool,
boxed answers without), the same seed, batch and completion budget. With the tool a step renders the tools' schemas
into every prompt (≈ 185 tokens instead of ≈ 40), samples a second round after each call (TRL's tool loop) and runs
the calls in the sandbox; both arms sample with grpoflow's transformers loop on this CPU.

``one at a time`` is the tool arm with ``tools.concurrent_calls: 1`` (every call after the last, as TRL's own loop runs
them). Prints per arm: seconds per GRPO step (the first step left out: it warms up), completion tokens per step, tool
calls per rollout, and the ratio of the two arms. Arms alternate (``--repeats``) since this machine's speed drifts.

    .venv/bin/python bench/bench_tool_steps.py [--steps 6] [--sft-steps 16] [--repeats 1]
    .venv/bin/python bench/bench_tool_steps.py --arms "with tool,one at a time"   # a round's calls side by side
                                                                                  # vs one after another
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402,F401  (environment defaults)
from tasks.config import load_config  # noqa: E402
from tasks.grpo import run_grpo  # noqa: E402
from tasks.models import resolve_model_source  # noqa: E402
from tasks.sft import run_sft  # noqa: E402
from tasks.training import read_ledger  # noqa: E402
from tasks.validate import run_validate  # noqa: E402

ARMS = {  # name: what the arm changes in configs/tools-demo.yaml
    "with tool": {},
    "one at a time": {"tools.concurrent_calls": 1},  # TRL's loop as TRL runs it: every call after the last
    "without": {"tools.use": []},
}
_SFT: dict[bool, tuple] = {}  # SFT depends only on whether the arm has the tool: trained once per kind


def arm(name: str, args: argparse.Namespace, work: Path) -> dict:
    tools = name != "without"
    overrides = {
        "output_dir": str(work / "out"),
        "sft.max_steps": args.sft_steps,
        "grpo.max_steps": args.steps,
        "grpo.checkpoint_steps": 0,
        "grpo.log_completions_every": 0,
        "grpo.stop.dead_signal_steps": 0,
        **ARMS[name],
    }
    config = load_config(ROOT / "configs" / "tools-demo.yaml", overrides)
    base = resolve_model_source(config.model.source)
    if tools not in _SFT:
        split = run_validate(config, work / "validate")
        _SFT[tools] = (split, run_sft(config, split.train_path, base, work / "sft"))
    split, sft = _SFT[tools]
    result = run_grpo(config, split.train_path, base, sft.adapter_dir, work / "grpo")
    times = [entry["step_time"] for entry in result.history if "step_time" in entry]
    rows = [row for row in read_ledger(work / "grpo" / "rollouts") if row.get("role") == "grpo"]
    steps = max(len(times), 1)
    return {
        "arm": name,
        "seconds_per_step": round(statistics.mean(times[1:] or times), 2),
        "step_times": [round(t, 2) for t in times],
        "completion_tokens_per_step": round(sum(r.get("completion_tokens") or 0 for r in rows) / steps, 1),
        "tool_calls_per_rollout": round(sum(r.get("tool_calls") or 0 for r in rows) / max(len(rows), 1), 2),
        "reward": round(statistics.mean(r["reward_total"] for r in rows), 3) if rows else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--arms", default="with tool,without", help=f"two of: {', '.join(ARMS)}")
    args = parser.parse_args()
    names = [name.strip() for name in args.arms.split(",")]
    if len(names) != 2 or not set(names) <= set(ARMS):
        parser.error(f"--arms names two of: {', '.join(ARMS)}")
    results = []
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            work = Path(tempfile.mkdtemp(prefix="bench-tools-"))
            results.append(arm(name, args, work))
            print(json.dumps(results[-1]), flush=True)
    per_arm = {name: statistics.mean(r["seconds_per_step"] for r in results if r["arm"] == name) for name in names}
    print(f"\n{'arm':12}{'s/step':>9}{'tokens/step':>13}{'calls/rollout':>15}")
    for r in results:
        print(
            f"{r['arm']:12}{r['seconds_per_step']:>9}{r['completion_tokens_per_step']:>13}"
            f"{r['tool_calls_per_rollout']:>15}"
        )
    print(f"{names[0]} / {names[1]}: {per_arm[names[0]] / per_arm[names[1]]:.2f}× per step")


if __name__ == "__main__":
    main()
