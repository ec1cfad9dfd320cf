#!/usr/bin/env bash
# Gate lookahead within a token (issue #21) on the embedded default (glm5_nano, CPU backend):
# the share of expert calls at 4 bits, and how many hinted loads land before their layer runs,
# with and without `nq-worker --lookahead_layers`, on a fixed set of prompts (greedy, so every
# mode decodes the same requests; the tokens may differ where precision does).
#
#   bash bench/serving/lookahead_landing.sh [BUILD_DIR] [MAX_TOKENS] [DEPTHS]
#
# Four modes, each a fresh cluster (streamer, worker with the release and dynamic experts,
# router; the predictor starts cold each time): slot changes applied through the slot mailbox
# (--slot_mailbox=on; with lookahead the model applies it before every MoE layer, so a hinted
# load can serve the token that asked for it) or between steps (--slot_mailbox=off: a hinted load
# serves later tokens only), each with lookahead off and at each of DEPTHS layers (comma-separated,
# default 1). Prints one
# markdown row per mode from the services' /metrics (differences over the prompt set, so the
# session's fixed-set loads at start are left out). Ports 185xx.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/cpu}
max_tokens=${2:-128}
depth=${3:-1}
model=$build/embedded-model
bin=$build/services
log=$(mktemp -d)
NQ_BIN=$bin/tools/nq bash scripts/embedded_model.sh "$model" >/dev/null

pids=()
stop() {
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT

run_mode() {  # name, mailbox (on|off), lookahead depth
  local name=$1 mailbox=$2 lookahead=$3
  "$bin/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=18500 --metrics_port=18501 \
    --records_dir="$model/release" >"$log/$name.streamer.log" 2>&1 &
  pids+=($!)
  "$bin/worker/nq-worker" --host=127.0.0.1 --grpc_port=18510 --metrics_port=18511 --backend=cpu --model="$model" \
    --served_model_name=embedded --release="$model/release" --streamer_address=127.0.0.1:18500 \
    --slot_mailbox="$mailbox" --lookahead_layers="$lookahead" >"$log/$name.worker.log" 2>&1 &
  pids+=($!)
  "$bin/router/nq-router" --host=127.0.0.1 --http_port=18520 --grpc_port=18521 --worker_address=127.0.0.1:18510 \
    --tokenizer="$model/tokenizer.json" --chat_format=plain >"$log/$name.router.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:18520/health >/dev/null && break
    sleep 0.2
  done
  curl -sf http://127.0.0.1:18520/health >/dev/null || { echo "$name: cluster not healthy; logs in $log" >&2; exit 1; }
  python3 - "$name" "$max_tokens" <<'PY'
import json, re, sys, time, urllib.request
name, max_tokens = sys.argv[1], int(sys.argv[2])
PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
    "def fibonacci(n):",
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n",
    "class LRUCache:\n    \"\"\"A least-recently-used cache.\"\"\"\n\n    def __init__(self, capacity):\n",
    "def read_csv(path):\n    rows = []\n",
]
def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(nq_[a-z0-9_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out
def wait_idle():  # the fixed set's loads at session start, then quiet
    for _ in range(200):
        s = scrape(18501)
        if s.get("nq_streamer_read_backlog_bytes", 0) == 0 and s.get("nq_streamer_sessions_active", 0) >= 1:
            return
        time.sleep(0.05)
wait_idle()
time.sleep(1)
w0, s0 = scrape(18511), scrape(18501)
tokens = 0
start = time.monotonic()
for prompt in PROMPTS:
    body = {"model": "embedded", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request("http://127.0.0.1:18520/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    tokens += json.loads(urllib.request.urlopen(req).read())["usage"]["completion_tokens"]
seconds = time.monotonic() - start
time.sleep(0.5)
w1, s1 = scrape(18511), scrape(18501)
d = lambda a, b, k: b.get(k, 0) - a.get(k, 0)
four = d(w0, w1, 'nq_expert_calls_total{bits="4"}')
two = d(w0, w1, 'nq_expert_calls_total{bits="2"}')
landed = d(w0, w1, 'nq_worker_lookahead_experts_total{outcome="landed"}')
missed = d(w0, w1, 'nq_worker_lookahead_experts_total{outcome="missed"}')
unrouted = d(w0, w1, 'nq_worker_lookahead_experts_total{outcome="unrouted"}')
sent = d(w0, w1, 'nq_worker_lookahead_hints_total{result="sent"}')
wdropped = d(w0, w1, 'nq_worker_lookahead_hints_total{result="dropped"}')
queued = d(s0, s1, 'nq_streamer_lookahead_loads_total{stage="queued"}')
ready = d(s0, s1, 'nq_streamer_lookahead_loads_total{stage="ready"}')
unplaced = d(s0, s1, 'nq_streamer_lookahead_loads_total{stage="unplaced"}')
refused = d(s0, s1, 'nq_streamer_lookahead_hints_total{result="refused"}')
sdropped = d(s0, s1, 'nq_streamer_lookahead_hints_total{result="dropped"}')
loads = d(s0, s1, 'nq_streamer_slot_loads_total{result="ready"}')
in_time = f"{landed / (landed + missed):.3f}" if landed + missed else "-"
hl_n = d(s0, s1, 'nq_streamer_lookahead_load_latency_seconds_count')
hint_ms = f"{1000 * d(s0, s1, 'nq_streamer_lookahead_load_latency_seconds_sum') / hl_n:.2f}" if hl_n else "-"
print(f"| {name} | {tokens} | {tokens / seconds:.1f} | {four / (four + two):.4f} | {loads:.0f} | {sent:.0f} "
      f"({wdropped:.0f} dropped) | {queued:.0f} / {ready:.0f} / {unplaced:.0f} | {landed:.0f} / {missed:.0f} / "
      f"{unrouted:.0f} | {in_time} | {hint_ms} | {1000 * seconds / tokens:.2f} | {refused:.0f} / {sdropped:.0f} |", flush=True)
PY
  stop
}

echo "| mode | tokens | tokens/s | 4-bit share of calls | slot loads | hints sent | hinted loads queued / ready / unplaced | hinted experts landed / missed / unrouted | landed in time | hint to READY, mean ms | ms per token | hints refused / dropped (streamer) |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
run_mode "mailbox, lookahead off" on 0
for d in ${depth//,/ }; do run_mode "mailbox, lookahead $d" on "$d"; done
run_mode "between steps, lookahead off" off 0
for d in ${depth//,/ }; do run_mode "between steps, lookahead $d" off "$d"; done
echo "logs: $log" >&2
