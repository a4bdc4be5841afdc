#!/usr/bin/env bash
# The demo with its samples from a vLLM server, as a user runs it: `grpoflow vllm-serve` in the background (its log
# under the demo's output folder), the pipeline against it once it answers, the server stopped at the end.
set -euo pipefail
venv=${VLLM_VENV:-.venv-vllm}
port=${VLLM_DEMO_PORT:-8000}
config=${1:-configs/demo.yaml}
shift || true
"$venv/bin/grpoflow" vllm-serve "$config" --port "$port" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 "$server" 2>/dev/null || { echo "the vLLM server ended before it answered (its log is named above)" >&2; exit 4; }
  sleep 2
done
"$venv/bin/grpoflow" run "$config" --set grpo.generation.backend=vllm --set grpo.generation.vllm_mode=server \
  --set "grpo.generation.vllm_server_base_url=http://127.0.0.1:$port" "$@"
