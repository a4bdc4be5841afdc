"""The champion watch on the real model, the case README shows: after `make demo` (v1, trained, is champion),
register an untrained LoRA adapter over SmolLM2 as v2 (the base model's behaviour, a weaker adapter for real),
force it to champion by hand, and let `grpoflow watch` with action rollback judge.

    .venv/bin/python bench/watch_demo_case.py      # after `make demo`; prints the watch's table and decision
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402,F401  (environment defaults)
from tasks.config import load_config  # noqa: E402
from tasks.layout import RunLayout  # noqa: E402
from tasks.models import resolve_model_source  # noqa: E402
from tasks.registry import client_for, register_adapter  # noqa: E402
from tasks.tracking import start_pipeline  # noqa: E402


def untrained_adapter(folder: Path, config) -> Path:
    from peft import get_peft_model

    from tasks.models import load_base_model
    from tasks.training import lora_config

    model = get_peft_model(load_base_model(resolve_model_source(config.model.source)), lora_config(config))
    model.save_pretrained(folder)  # LoRA B starts at zero: the base model's outputs
    return folder


def main() -> None:
    config = load_config(ROOT / "configs" / "demo.yaml")
    name = config.tracking.registered_model_name
    client = client_for(config.resolved_tracking_uri())
    tracker = start_pipeline(config, RunLayout(config.output_dir / "watch-case-untrained"))
    with tempfile.TemporaryDirectory() as scratch, tracker.stage("promote") as stage:
        stage.log_artifact(untrained_adapter(Path(scratch) / "adapter", config), "adapter")
        version = register_adapter(client, name, stage.run_id, "adapter", {"base_model": config.model.source})
    grpoflow = [sys.executable, "-m", "flows.cli"]
    subprocess.run(
        [
            *grpoflow,
            "rollback",
            name,
            "--to",
            version,
            "--reason",
            "an untrained adapter, forced by hand",
            "--config",
            "configs/demo.yaml",
        ],
        cwd=ROOT,
        check=True,
    )
    subprocess.run(
        [
            *grpoflow,
            "watch",
            "--config",
            "configs/demo.yaml",
            "--set",
            "watch.action=rollback",
            "--set",
            "watch.cooldown_h=0",
        ],
        cwd=ROOT,
        check=True,
    )
    subprocess.run([*grpoflow, "history", name, "--config", "configs/demo.yaml"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
