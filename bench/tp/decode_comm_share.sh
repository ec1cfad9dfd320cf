#!/usr/bin/env bash
# The share of a decode step spent in tensor-parallel collectives on a W-rank CPU cluster
# (bench/README.md, "Tensor parallelism: communication cost"). Starts nq-streamer, W nq-worker
# ranks (shared-memory transport) and nq-router on glm5_nano's embedded model and its W-rank
# release, as scripts/up.sh's NQ_TP=W does but on ports of its own; sends N greedy completions
# of T tokens; then reads each rank's /metrics:
#   nq_worker_tp_step_collective_seconds  time inside collectives per decode step
#   nq_worker_tp_collective_seconds{op}   per call (all_reduce: two per layer; all_gather: logits)
#   nq_worker_step_seconds{phase="decode"} rank 0's decode step (forward + sampling)
#   nq_worker_tp_command_seconds          rank 0 sending each step command
#
#   bash bench/tp/decode_comm_share.sh [W=2] [requests=8] [tokens=64]
# Needs: cmake --build build/cpu --target nq-router nq-worker nq-streamer nq, and the embedded
# model with its W-rank release (the cluster tests' fixture writes build/cpu/embedded-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-2}
N=${2:-8}
T=${3:-64}
bin=build/cpu/services
model=${NQ_MODEL:-build/cpu/embedded-model}
release=$model/release_tp$W
((W == 1)) && release=$model/release  # W = 1: the step time without collectives, for comparison
[[ -f $release/COMPLETE ]] || { echo "$release missing: nq encode --model $model --out $release --tp $W --fixed-per-layer 4" >&2; exit 2; }
run=$(mktemp -d /tmp/nq-tp-share.XXXXXX)
base=${NQ_PORT_BASE:-23000}
router_http=$base; router_grpc=$((base + 1)); worker_grpc=$((base + 10)); streamer=$((base + 20))
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
"$bin/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=$streamer --metrics_port=$((streamer + 1)) \
  --records_dir="$release" >"$run/streamer.log" 2>&1 &
pids+=($!)
for ((r = 0; r < W; r++)); do
  "$bin/worker/nq-worker" --host=127.0.0.1 --backend=cpu --model="$model" --release="$release" \
    --rank=$r --world_size=$W --grpc_port=$worker_grpc --leader_address=127.0.0.1:$worker_grpc \
    --metrics_port=$((base + 30 + r)) --streamer_address=127.0.0.1:$streamer >"$run/worker$r.log" 2>&1 &
  pids+=($!)
done
"$bin/router/nq-router" --host=127.0.0.1 --http_port=$router_http --grpc_port=$router_grpc \
  --worker_address=127.0.0.1:$worker_grpc \
  --tokenizer=models/glm5_nano/tokenizer.json --chat_format=plain >"$run/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$router_http/health" >/dev/null && break
  sleep 0.2
done
curl -sf "http://127.0.0.1:$router_http/health" >/dev/null || { echo "cluster not healthy; logs in $run" >&2; exit 1; }
for ((i = 0; i < N; i++)); do
  curl -sf "http://127.0.0.1:$router_http/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"embedded-model\",\"prompt\":\"def f$i(x):\",\"max_tokens\":$T,\"temperature\":0,\"ignore_eos\":true}" \
    >"$run/completion$i.json"
done
for ((r = 0; r < W; r++)); do curl -sf "http://127.0.0.1:$((base + 30 + r))/metrics" >"$run/metrics$r.txt"; done
python3 - "$run" "$W" <<'PY'
import re, sys
run, W = sys.argv[1], int(sys.argv[2])
def read(path):
    out = {}
    for line in open(path):
        if line.startswith('#'): continue
        m = re.match(r'([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$', line.strip())
        if m: out[m.group(1) + (m.group(2) or '')] = float(m.group(3))
    return out
def quantile(m, name, labels, q):
    # Upper bound of the bucket holding quantile q (Prometheus histogram_quantile without interpolation).
    buckets = sorted((float('inf') if le == '+Inf' else float(le), v) for k, v in m.items()
                     for le in re.findall(r'le="([^"]+)"', k) if k.startswith(name + '_bucket') and labels in k)
    total = buckets[-1][1] if buckets else 0
    for le, c in buckets:
        if total and c >= q * total: return le
    return float('nan')
for r in range(W):
    m = read(f"{run}/metrics{r}.txt")
    s = m.get('nq_worker_tp_step_collective_seconds_sum', 0); n = m.get('nq_worker_tp_step_collective_seconds_count', 0)
    ar_s = m.get('nq_worker_tp_collective_seconds_sum{op="all_reduce"}', 0); ar_n = m.get('nq_worker_tp_collective_seconds_count{op="all_reduce"}', 0)
    ag_s = m.get('nq_worker_tp_collective_seconds_sum{op="all_gather"}', 0); ag_n = m.get('nq_worker_tp_collective_seconds_count{op="all_gather"}', 0)
    print(f"rank {r}: {n:.0f} decode steps, {1e3*s/max(n,1):.3f} ms in collectives per step "
          f"(p50 <= {1e3*quantile(m,'nq_worker_tp_step_collective_seconds','',0.5):.3f} ms, p99 <= {1e3*quantile(m,'nq_worker_tp_step_collective_seconds','',0.99):.3f} ms); "
          f"all_reduce {ar_n:.0f} calls, mean {1e6*ar_s/max(ar_n,1):.1f} us (p50 <= {1e6*quantile(m,'nq_worker_tp_collective_seconds','all_reduce',0.5):.0f} us, p99 <= {1e6*quantile(m,'nq_worker_tp_collective_seconds','all_reduce',0.99):.0f} us); "
          f"all_gather {ag_n:.0f} calls, mean {1e6*ag_s/max(ag_n,1):.1f} us")
    if r == 0:
        ds = m.get('nq_worker_step_seconds_sum{phase="decode"}', 0); dn = m.get('nq_worker_step_seconds_count{phase="decode"}', 0)
        cs = m.get('nq_worker_tp_command_seconds_sum', 0); cn = m.get('nq_worker_tp_command_seconds_count', 0)
        print(f"rank 0: {dn:.0f} decode steps, {1e3*ds/max(dn,1):.3f} ms per step (p50 <= {1e3*quantile(m,'nq_worker_step_seconds','decode',0.5):.3f} ms, p99 <= {1e3*quantile(m,'nq_worker_step_seconds','decode',0.99):.3f} ms); "
              f"step commands {cn:.0f}, mean {1e6*cs/max(cn,1):.1f} us")
        if ds > 0 and dn > 0:
            # A decode step sends its forward's command and a cache truncation's: every command's time
            # over the decode steps (the prefills' few commands included: an upper bound).
            print(f"rank 0: collectives are {100*(s/max(n,1))/(ds/dn):.1f} % of a decode step; with the step commands "
                  f"({cn/dn:.2f} per step) {100*(s/max(n,1) + cs/dn)/(ds/dn):.1f} %")
PY
echo "logs and metrics in $run"
