#!/usr/bin/env bash
# Starts streamer, worker (the embedded model, experts streamed from its release, the arena
# sized by default so the predictor has floating slots) and router (the plain chat format, as
# scripts/up.sh serves the embedded model) on free loopback ports, runs the real `openai` npm
# client against them (openai_client.mjs), checks that streaming ran with floating slots, and
# stops everything.
# Usage: run_openai_client.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:?usage: run_openai_client.sh BUILD_DIR}
if [[ ! -d "$here/node_modules/openai" ]]; then
  echo "the openai client is not installed: run scripts/setup.sh (npm ci --prefix tests/e2e)" >&2
  exit 1
fi
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  rm -rf "$work"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The embedded model and its release, prepared once per build tree (shared with cluster_test).
model="$build/embedded-model"
NQ_BIN="$build/services/tools/nq" bash "$root/scripts/embedded_model.sh" "$model" >/dev/null
sg=$(port); sm=$(port); wg=$(port); wm=$(port); rh=$(port); rg=$(port)
"$build/services/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=$sg --metrics_port=$sm \
  --records_dir="$model/release" >"$work/streamer.log" 2>&1 &
pids+=($!)
"$build/services/worker/nq-worker" --host=127.0.0.1 --grpc_port=$wg --metrics_port=$wm \
  --streamer_address=127.0.0.1:$sg --model="$model" --release="$model/release" --served_model_name=embedded \
  --max_model_len=512 \
  >"$work/worker.log" 2>&1 &
pids+=($!)
"$build/services/router/nq-router" --host=127.0.0.1 --http_port=$rh --grpc_port=$rg \
  --worker_address=127.0.0.1:$wg --worker_poll_interval_s=0.1 --tokenizer="$model/tokenizer.json" \
  --chat_format=plain >"$work/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$rh/health" >/dev/null && break
  sleep 0.1
done
if ! node "$here/openai_client.mjs" "http://127.0.0.1:$rh/v1" "http://127.0.0.1:$sm/metrics"; then
  tail -n 20 "$work"/*.log >&2
  exit 1
fi
# The default arena must leave the predictor something to place (issue #11).
if ! grep -Eq "fixed-set loads queued, [1-9][0-9]* floating slots per layer" "$work/streamer.log"; then
  echo "the worker's session has no floating slots: streaming ran with the fixed set only" >&2
  tail -n 20 "$work"/*.log >&2
  exit 1
fi
