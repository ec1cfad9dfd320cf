#!/usr/bin/env bash
# Decode speed of the embedded default (glm5_nano, CPU backend) through the router's HTTP
# stream, as a newcomer meets it (scripts/up.sh's cluster: streamer, worker with the release
# and dynamic experts, router). Prints, per run, the tokens per second from the first streamed
# token to the last (decode only) and over the whole request, and the worker's CPU time per
# token (user + system, all its threads): the figure to compare when other work shares the
# cores and wall-clock rates swing.
#
#   bash bench/serving/stream_tps.sh [BUILD_DIR] [RUNS] [MAX_TOKENS]
#
# BUILD_DIR defaults to build/cpu (binaries and the embedded model it prepared). Ports 18xxx.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/cpu}
runs=${2:-3}
max_tokens=${3:-256}
model=$build/embedded-model
bin=$build/services
log=$(mktemp -d)
NQ_BIN=$bin/tools/nq bash scripts/embedded_model.sh "$model" >/dev/null

pids=()
stop() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  wait || true
}
trap stop EXIT
"$bin/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=18200 --metrics_port=18201 \
  --records_dir="$model/release" >"$log/streamer.log" 2>&1 &
pids+=($!)
"$bin/worker/nq-worker" --host=127.0.0.1 --grpc_port=18100 --metrics_port=18101 --backend=cpu --model="$model" --served_model_name=embedded \
  --release="$model/release" --streamer_address=127.0.0.1:18200 >"$log/worker.log" 2>&1 &
worker_pid=$!
pids+=($!)
"$bin/router/nq-router" --host=127.0.0.1 --http_port=18000 --grpc_port=18001 --worker_address=127.0.0.1:18100 \
  --tokenizer="$model/tokenizer.json" --chat_format=plain >"$log/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 150); do
  curl -sf http://127.0.0.1:18000/health >/dev/null && break
  sleep 0.2
done
curl -sf http://127.0.0.1:18000/health >/dev/null || { echo "cluster not healthy; logs in $log" >&2; exit 1; }

python3 - "$runs" "$max_tokens" "$worker_pid" <<'PY'
import json, os, sys, time, urllib.request
runs, max_tokens, worker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def cpu_seconds():  # utime + stime of the worker process, all threads
    fields = open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
body = {"model": "embedded", "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
for run in range(runs + 1):  # run 0 warms up (page cache, slots)
    req = urllib.request.Request("http://127.0.0.1:18000/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.monotonic(); first = None; tokens = 0; cpu0 = cpu_seconds()
    with urllib.request.urlopen(req) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.monotonic()
    end = time.monotonic(); cpu = cpu_seconds() - cpu0
    if run == 0:
        continue
    print(f"run {run}: {tokens} tokens, decode {(tokens - 1) / (end - first):.1f} tokens/s, "
          f"whole request {tokens / (end - start):.1f} tokens/s, worker CPU {1000 * cpu / tokens:.2f} ms/token")
PY
