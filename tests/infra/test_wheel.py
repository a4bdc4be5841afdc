"""grpoflow installed from a plain (non-editable) wheel finds the data it ships beside its modules: the forgetting
check's general sets, the reward canaries, and the moved-module aliases that old registered versions import."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import tasks.evaluation.forgetting as forgetting, reward_fns.canaries as canaries, tasks.data, tasks.models
files = [forgetting.DEFAULT_CORPUS, forgetting.DEFAULT_QUESTIONS, *sorted(canaries.CANARY_DIR.glob("*.jsonl"))]
print(json.dumps({"module": forgetting.__file__, "files": [str(f) for f in files if f.is_file()],
                  "render_prompt": hasattr(tasks.data, "render_prompt"),
                  "load_policy": hasattr(tasks.models, "load_policy")}))
"""


def test_an_installed_wheel_finds_its_data_files(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy of the tracked files: pip builds in the tree it is given
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if name.split("/")[0] in ("tasks", "flows", "reward_fns") or name in ("pyproject.toml", "README.md"):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("grpoflow-*.whl"))
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the editable install of this checkout
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    found = json.loads(out.stdout)
    assert found["module"].startswith(str(site))  # the wheel's copy, not this checkout
    assert len(found["files"]) >= 2 + 5 and all(f.startswith(str(site)) for f in found["files"])
    assert found["render_prompt"] and found["load_policy"]
