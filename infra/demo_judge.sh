#!/usr/bin/env bash
# The judged demo as a user runs it: the judge (SmolLM2-135M-Instruct) served by `grpoflow vllm-serve --judge` in the
# background on port 8011 (its log under the demo's output folder), the pipeline once it answers, the judge stopped
# at the end. The policy trains with grpoflow's own transformers loop in the same venv.
set -euo pipefail
venv=${VLLM_VENV:-.venv-vllm}
port=${JUDGE_DEMO_PORT:-8011}
config=${1:-configs/judge-demo.yaml}
judge=${JUDGE_MODEL:-smollm2-135m-instruct}
shift || true
"$venv/bin/grpoflow" vllm-serve "$config" --judge "$judge" --port "$port" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 "$server" 2>/dev/null || { echo "the judge's vLLM server ended before it answered (its log is named above)" >&2; exit 4; }
  sleep 2
done
"$venv/bin/grpoflow" run "$config" --set "rewards.0.args.url=http://127.0.0.1:$port/v1" "$@"
