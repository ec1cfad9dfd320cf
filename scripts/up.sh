#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, writes the embedded default
# model (scripts/embedded_model.sh) and runs the cluster on this machine (CPU backend) in the
# foreground: nq-streamer streaming the model's NestQuant release, nq-worker (rank 0) serving
# the model's routed experts from it (2-bit base, 4 bits from READY slots), nq-router with its
# tokenizer.
# Ctrl-C (or SIGTERM) drains and stops all three. Logs go to $NQ_RUN_DIR (default .run/).
#
# On a GPU machine, NQ_BACKEND=cuda builds the cuda preset and runs the worker on GPU NQ_GPU
# (default 0): model, KV cache and slot arena in device memory, residuals written there by the
# streamer through CUDA IPC. NQ_MODEL=DIR (with DIR/release, from nq encode) serves a model of
# your own.
#
# NQ_TP=W (CPU backend) runs tensor parallelism across W worker processes: rank 0 serves the
# router, ranks 1..W-1 (metrics on ports 8110+r) follow it over shared memory. Their experts stream
# from a release encoded for W ranks ($model/release_tpW, encoded once for the embedded model):
# the streamer decides for the whole group and rank 0 relays each slot-table change to the other
# ranks with the step at which every rank applies it.
#
# NQ_NODES=N (with NQ_TP a multiple of N) rehearses a group spanning N nodes on this machine: one
# streamer per "node" (node n's gRPC on 8200+10n, metrics 8201+10n), node n's ranks registered with
# its own; node 0's streamer decides for the group and the others read their ranks' records on its
# orders (--decider_address; docs/tp_streamers.md). The ranks then talk to rank 0 over TCP
# (--tp_control=tcp on 127.0.0.1:8190), as ranks on other hosts must.
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${NQ_BACKEND:-cpu}
case "$backend" in
  cpu) preset=cpu ;;
  cuda) preset=cuda ;;
  *) echo "NQ_BACKEND=$backend: want cpu or cuda" >&2; exit 2 ;;
esac
tp=${NQ_TP:-1}
if ! [[ "$tp" =~ ^[1-9][0-9]*$ ]]; then echo "NQ_TP=$tp: want a world size >= 1" >&2; exit 2; fi
nodes=${NQ_NODES:-1}
if ! [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || ((tp % nodes != 0)); then
  echo "NQ_NODES=$nodes: want a number of nodes >= 1 that divides NQ_TP=$tp" >&2
  exit 2
fi
if ((tp > 1)) && [[ "$backend" != cpu ]]; then
  echo "NQ_TP=$tp: up.sh starts tensor-parallel groups on the cpu backend only; on GPUs start one nq-worker" \
    "per GPU (--backend cuda --world_size $tp --rank r --gpu r; README.md)" >&2
  exit 2
fi
bash scripts/setup.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)" --target nq-router nq-worker nq-streamer nq

bin=build/$preset/services
run_dir=${NQ_RUN_DIR:-.run}
mkdir -p "$run_dir"
model=${NQ_MODEL:-$run_dir/embedded}
# The embedded default is written (once) into .run/embedded; a model of your own is used as it is
# (embedded_model.sh would overwrite its files with glm5_nano's).
if [[ -z "${NQ_MODEL:-}" ]]; then
  NQ_BIN="$bin/tools/nq" bash scripts/embedded_model.sh "$model"
elif [[ ! -f "$model/release/COMPLETE" ]]; then
  echo "NQ_MODEL=$model has no release in $model/release (make one with: nq encode --model $model --out $model/release)" >&2
  exit 2
fi
# With W > 1 each rank streams its own slice of every expert: a release encoded for W ranks.
release="$model/release"
if ((tp > 1)); then
  release="$model/release_tp$tp"
  if [[ ! -f "$release/COMPLETE" ]]; then
    if [[ -n "${NQ_MODEL:-}" ]]; then
      echo "NQ_TP=$tp: $release is missing (make one with: nq encode --model $model --out $release --tp $tp)" >&2
      exit 2
    fi
    rm -rf "$release"
    "$bin/tools/nq" encode --model "$model" --out "$release" --tp "$tp" --fixed-per-layer 4 >/dev/null
  fi
fi
pids=()
stop() {
  trap - INT TERM EXIT
  echo "stopping cluster (draining)..."
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  wait || true
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

"$bin/streamer/nq-streamer" --host=127.0.0.1 --records_dir="$release" "$@" >"$run_dir/streamer.log" 2>&1 &
pids+=($!)
# The other "nodes'" streamers (NQ_NODES): each applies node 0's decisions to its node's ranks.
for ((n = 1; n < nodes; n++)); do
  "$bin/streamer/nq-streamer" --host=127.0.0.1 --records_dir="$release" --grpc_port=$((8200 + 10 * n)) \
    --metrics_port=$((8201 + 10 * n)) --decider_address=127.0.0.1:8200 "$@" >"$run_dir/streamer-node$n.log" 2>&1 &
  pids+=($!)
done
# The slot arena is sized from the release: its fixed set, 2 x top-k floating slots, 1 staging.
if ((tp == 1)); then
  "$bin/worker/nq-worker" --host=127.0.0.1 --backend="$backend" --gpu="${NQ_GPU:-0}" --model="$model" \
    --release="$model/release" \
    >"$run_dir/worker.log" 2>&1 &
  pids+=($!)
else
  for ((r = 0; r < tp; r++)); do
    log="$run_dir/worker.log"
    ((r == 0)) || log="$run_dir/worker-rank$r.log"
    metrics=8101
    ((r == 0)) || metrics=$((8110 + r))
    node=$((r / (tp / nodes)))
    control=()
    ((nodes == 1)) || control=(--tp_control=tcp --node_rank="$node" --ranks_per_node=$((tp / nodes)))
    "$bin/worker/nq-worker" --host=127.0.0.1 --backend=cpu --model="$model" --release="$release" \
      --rank=$((r % (tp / nodes))) --world_size="$tp" --leader_address=127.0.0.1:8100 --metrics_port="$metrics" \
      --streamer_address=127.0.0.1:$((8200 + 10 * node)) "${control[@]}" >"$log" 2>&1 &
    pids+=($!)
  done
fi
# The embedded model was trained on Python sources only and never saw chat markup: its chats
# are plain text it continues (--chat_format=plain). A model of your own (NQ_MODEL) gets the
# template of its architecture.
if [[ -z "${NQ_MODEL:-}" ]]; then chat_format=plain; else chat_format=auto; fi
"$bin/router/nq-router" --host=127.0.0.1 --tokenizer="$model/tokenizer.json" --chat_format="$chat_format" \
  >"$run_dir/router.log" 2>&1 &
pids+=($!)

for _ in $(seq 1 100); do
  if curl -sf http://127.0.0.1:8000/health >/dev/null; then
    echo "cluster up: router HTTP http://127.0.0.1:8000 (OpenAI API: /v1/chat/completions, /v1/completions, /v1/models), gRPC 127.0.0.1:8001"
    echo "try: curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\":\"embedded\",\"messages\":[{\"role\":\"user\",\"content\":\"def fibonacci(n):\"}],\"max_tokens\":32}'"
    echo "logs in $run_dir/; Ctrl-C to stop"
    wait -n || true
    echo "a service exited; see $run_dir/*.log" >&2
    exit 1
  fi
  sleep 0.2
done
echo "cluster did not become healthy in 20 s; see $run_dir/*.log" >&2
exit 1
