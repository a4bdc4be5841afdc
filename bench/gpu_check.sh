#!/usr/bin/env bash
# The GPU check on a lent GPU machine (no network; torch and transformers there, TRL, PEFT, Prefect and MLflow not),
# with .gpu-check carried (made here by `.venv/bin/python bench/gpu_check.py bundle`): the carried wheels go into
# a folder of their own ahead of the machine's packages, then bench/gpu_check.py runs (4 minutes at most).
# Arguments go to `gpu_check.py run`; the report also lands in $OUT/gpu_check.json where $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .gpu-check/wheels ] || { echo "gpu-check: no .gpu-check/wheels here (carry .gpu-check)"; exit 2; }
site=$(mktemp -d /tmp/gpu-check-site.XXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu-check/wheels/*.whl
export PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 240 python3 bench/gpu_check.py run ${OUT:+--json "$OUT/gpu_check.json"} "$@"
