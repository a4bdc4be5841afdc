"""`make ui-check`: what a user sees in the UIs after a run, checked in a real browser.

Starts `grpoflow up` on a temporary store, runs the tiny pipeline against it, makes its version `@champion`
(`grpoflow rollback --to`, as a user would), then has headless Chromium load the Prefect flow-run page and the
MLflow registered-model page. It asserts on the rendered DOM text (the run, its stages, the evaluation artifact,
the `@champion` alias), not only on pictures, and saves screenshots (README shows them).

    python infra/ui_check.py [--screenshots docs/]

Exits non-zero naming what a page lacked. Outside `make test`: it needs Chromium (the Makefile installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.services import free_port  # noqa: E402


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise SystemExit("ui-check: no Chromium found (apt-get install chromium)")


def browse(url: str, screenshot: Path | None = None, wait_ms: int = 20000) -> str:
    """The page's DOM after its scripts ran for ``wait_ms`` (virtual time); a screenshot too when asked."""
    flags = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--virtual-time-budget={wait_ms}",
        "--window-size=1440,1000",
    ]
    if screenshot is not None:
        subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True)
    return dom.stdout


def browse_until(url: str, needle: str, attempts: int = 3) -> str:
    """The page's text once it shows ``needle``: lists fill in after their API calls, so each try waits longer."""
    text = ""
    for attempt in range(attempts):
        text = text_of(browse(url, wait_ms=20000 * (attempt + 1)))
        if needle in text:
            break
    return text


def text_of(dom: str) -> str:
    """Visible text of a DOM dump, roughly: tags dropped, whitespace folded."""
    import html
    import re

    dom = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def post(url: str, body: dict) -> list | dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def require(page: str, text: str, wanted: list[str]) -> list[str]:
    missing = [item for item in wanted if item not in text]
    print(f"{page}: {'ok' if not missing else 'MISSING ' + ', '.join(missing)}")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshots", type=Path, default=None, help="Folder for the PNGs (default: a temp dir).")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpoflow-ui-check-"))
    shots = (args.screenshots or work).resolve()
    shots.mkdir(parents=True, exist_ok=True)
    config = work / "tiny.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text() + f"\noutput_dir: {work / 'outputs'}\n")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PREFECT_HOME": str(work / "prefect"),
        "GRPOFLOW_CACHE": os.environ.get("GRPOFLOW_CACHE", str(work / "cache")),
    }
    env.pop("PREFECT_API_URL", None)
    grpoflow = [sys.executable, "-m", "flows.cli"]
    prefect_port, mlflow_port = free_port(), free_port()
    ports = ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    log = (work / "up.log").open("wb")
    up = subprocess.Popen(
        [*grpoflow, "up", "--config", str(config), *ports],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prefect, mlflow = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(f"{prefect}/api/health", timeout=2)
                urllib.request.urlopen(f"{mlflow}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            print((work / "up.log").read_text()[-2000:])
            return 1
        print(f"grpoflow up: Prefect {prefect}, MLflow {mlflow}")
        run_id = "ui-check-run"
        started = time.monotonic()
        ran = subprocess.run(
            [*grpoflow, "run", str(config), "--run-id", run_id],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        )
        print(f"tiny run: {time.monotonic() - started:.0f} s")
        run_link = next(line.split(": ", 1)[1] for line in ran.stdout.splitlines() if line.startswith("MLflow run"))
        subprocess.run(
            [*grpoflow, "rollback", "grpoflow-tiny", "--to", "1", "--reason", "ui-check", "--config", str(config)],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        runs = post(f"{prefect}/api/flow_runs/filter", {"flow_runs": {"name": {"any_": [run_id]}}})
        flow_run = runs[0]["id"]
        missing = []
        page = f"{prefect}/runs/flow-run/{flow_run}"
        text = text_of(browse(page, shots / "ui-prefect-run.png"))
        missing += require("Prefect flow run", text, [run_id, "Completed"])
        missing += require("Prefect run log", text, ["stage validate finished", "probe-base-verdict"])
        text = browse_until(f"{prefect}/runs?tab=task-runs", run_id)
        stages = ["validate-", "probe-base", "sft-", "probe-sft", "grpo-", "evaluate-", "promote-"]
        missing += require("Prefect task runs", text, [run_id, *stages])
        text = browse_until(f"{prefect}/artifacts/key/evaluation", run_id)
        missing += require("Prefect evaluation artifact", text, ["evaluation", f"Flow run {run_id}", "evaluate-"])
        text = text_of(browse(f"{mlflow}/#/models/grpoflow-tiny", shots / "ui-mlflow-model.png"))
        missing += require("MLflow registered model", text, ["grpoflow-tiny", "Version 1", "@ champion"])
        text = text_of(browse(run_link, shots / "ui-mlflow-run.png"))
        missing += require(f"MLflow run page ({run_link})", text, [run_id, "Metrics", "Model registry"])
        if "Evaluation runs" in text:  # MLflow 3's GenAI view: not where training runs are
            missing.append("the run page opened in MLflow's GenAI view")
        print(f"screenshots: {shots}")
        return 1 if missing else 0
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
