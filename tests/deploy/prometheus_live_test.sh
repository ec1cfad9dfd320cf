#!/usr/bin/env bash
# Debian's Prometheus server with deploy/prometheus's config against a live CPU cluster:
# starts Prometheus with only the config's targets (and a 1 s scrape and rule interval)
# rewritten to free loopback ports, then streamer, worker (the embedded model, experts
# streamed from its release) and router on them, sends a few requests, and runs
# check_live.mjs: all three jobs up, every rule healthy, every dashboard and rule expression
# evaluated without error, and the dashboard's panels returning data.
# Usage: prometheus_live_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
NQ_ROOT=${1:?usage: prometheus_live_test.sh SOURCE_DIR BUILD_DIR}
build=${2:?usage: prometheus_live_test.sh SOURCE_DIR BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
need prometheus node curl
need_node_modules

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  rm -rf "$work"
}
trap cleanup EXIT
logs() { tail -n 20 "$work"/*.log >&2 || true; }
port() { node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }

# The embedded model and its release, prepared once per build tree (shared with cluster_test
# and the openai end-to-end test).
model="$build/embedded-model"
NQ_BIN="$build/services/tools/nq" bash "$NQ_ROOT/scripts/embedded_model.sh" "$model" >/dev/null
sg=$(port); sm=$(port); wg=$(port); wm=$(port); rh=$(port); rg=$(port); pp=$(port)
prom=http://127.0.0.1:$pp

# deploy/prometheus as shipped, with only the targets and intervals changed.
mkdir -p "$work/prometheus"
cp "$NQ_ROOT/deploy/prometheus/alerts.yml" "$work/prometheus/"
node "$here/local_prometheus_config.mjs" "$NQ_ROOT/deploy/prometheus/prometheus.yml" \
  "nq-router=127.0.0.1:$rh" "nq-streamer=127.0.0.1:$sm" "nq-worker=127.0.0.1:$wm" \
  >"$work/prometheus/prometheus.yml"
promtool check config "$work/prometheus/prometheus.yml" >/dev/null
prometheus --config.file="$work/prometheus/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$pp" --log.level=warn >"$work/prometheus.log" 2>&1 &
pids+=($!)
"$build/services/streamer/nq-streamer" --host=127.0.0.1 --grpc_port="$sg" --metrics_port="$sm" \
  --records_dir="$model/release" >"$work/streamer.log" 2>&1 &
pids+=($!)
# The worker's fixed-set loads (record reads) start when it registers: Prometheus must have
# scraped the streamer once before, or the read counters never show an increase.
scraped=0
for _ in $(seq 1 300); do
  if curl -sf "$prom/api/v1/query?query=up%7Bjob%3D%22nq-streamer%22%7D%3D%3D1" | grep -q '"value"'; then
    scraped=1
    break
  fi
  sleep 0.1
done
if ((!scraped)); then
  echo "Prometheus did not scrape the streamer in 30 s" >&2
  logs
  exit 1
fi
# 13 slots per layer (as scripts/up.sh): floating slots beside the fixed set, so decoding
# moves residuals (reads, loads, unmaps, predictor refreshes). MTP drafts on (the CPU backend's
# default is off) so the dashboard's MTP panels have data as on a GPU deployment.
"$build/services/worker/nq-worker" --host=127.0.0.1 --grpc_port="$wg" --metrics_port="$wm" \
  --streamer_address="127.0.0.1:$sg" --model="$model" --release="$model/release" \
  --served_model_name=embedded --max_model_len=512 --slots_per_layer=13 --speculative_tokens=3 \
  >"$work/worker.log" 2>&1 &
pids+=($!)
"$build/services/router/nq-router" --host=127.0.0.1 --http_port="$rh" --grpc_port="$rg" \
  --worker_address="127.0.0.1:$wg" --worker_poll_interval_s=0.1 --tokenizer="$model/tokenizer.json" \
  >"$work/router.log" 2>&1 &
pids+=($!)

ready=0
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$rh/health" >/dev/null; then ready=1; break; fi
  sleep 0.1
done
if ((!ready)); then
  echo "the cluster did not become healthy in 30 s" >&2
  logs
  exit 1
fi

# Every target scraped once before the requests, so their counters' increase shows.
node "$here/check_live.mjs" wait "$NQ_ROOT" "$prom" || { logs; exit 1; }
# A few requests (past the 16-token routing report), so every panel has data.
for prompt in "def fibonacci(n):" "import os" "class Stack:" "def main():"; do
  curl -sf "http://127.0.0.1:$rh/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"embedded\",\"prompt\":\"$prompt\",\"max_tokens\":40}" >/dev/null || { logs; exit 1; }
done
curl -sf "http://127.0.0.1:$rh/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"embedded","messages":[{"role":"user","content":"def add(a, b):"}],"max_tokens":40,"stream":true}' \
  >/dev/null || { logs; exit 1; }

if ! node "$here/check_live.mjs" check "$NQ_ROOT" "$prom"; then
  logs
  exit 1
fi
