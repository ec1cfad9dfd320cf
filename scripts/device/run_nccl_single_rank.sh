#!/usr/bin/env bash
# One device call for NCCL on one H200 (issue #18), over the .gpu-cluster bundle:
#
#   NQ_NO_READ_BENCH=1 NQ_EXTRA_BINS="nccl_allreduce_bench=build/cuda/bench/tp/nccl_allreduce_bench" \
#     bash scripts/device/package_cluster.sh          # after: cmake --build build/cuda --target nccl_allreduce_bench
#   bash scripts/device/slim_tree.sh on
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_nccl_single_rank.sh"
#   bash scripts/device/slim_tree.sh off
#
# 1. nccl_allreduce_bench (bench/tp): a W = 1 NCCL data plane made by the worker's own factory
#    (rank 0's bootstrap through its wire format, the non-blocking join) on the CUDA backend's
#    stream; the all-reduce between two backend kernels inside a graph the backend captures (the
#    decode step graphs' mechanism) against the same ops run eagerly; latency per call at hidden
#    6144 and 7168, F32 and BF16, eager and inside a graph.
# 2. The worker's NCCL wiring end to end: nq-worker ranks 0 and 1 of --world_size=2 --backend=cuda
#    both on GPU 0. Rank 1 joins the shared-memory group, receives rank 0's unique id, and both
#    call ncclCommInitRank: NCCL refuses two ranks on one GPU, and the follower must exit saying so
#    (NCCL's own error string) while rank 0 stays up, not serving, naming the reason.
# 3. Greedy tokens: the CUDA worker's decode graph (W = 1, step graphs on) against the CPU
#    shared-memory path (a W = 2 group of CPU workers), 64 greedy tokens on 4 prompts of glm5_nano,
#    checkpoint experts. (A W = 1 model calls no collective and W > 1 turns step graphs off
#    (services/model/step_graph.cc), so the model's own graph does not contain the NCCL call:
#    item 1's captured graph is where the all-reduce runs inside one.)
# Results: $OUT/nccl_log.txt (everything printed), $OUT/logs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nq-nccl-single-rank-out}"
mkdir -p "$out/logs"
exec > >(tee "$out/nccl_log.txt") 2>&1
source scripts/device/unpack_cluster_bundle.sh  # sets $work
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
B=$work/bin
M=$work/model
for b in nq-worker nccl_allreduce_bench; do
  if [[ ! -x $B/$b ]] || ldd "$B/$b" | grep -q "not found"; then
    echo "$b missing or unresolved:"; ldd "$B/$b" 2>&1 | grep "not found"; exit 1
  fi
done
echo "libnccl: $(ldd "$B/nq-worker" | grep nccl)"
failed=()

echo "== 1. nccl_allreduce_bench"
# NCCL_DEBUG=WARN here too: a failed join reports only ncclGetErrorString's "unhandled system error"
# (no socket interface, topology under a sandboxed /sys, ...); NCCL's WARN line says which.
NCCL_DEBUG=WARN "$B/nccl_allreduce_bench" --calls=2000 --graph_runs=200 || failed+=("nccl_allreduce_bench")

echo "== 2. two ranks on one GPU: refused by NCCL, by name"
group=/nq-tp-nccl-check-$$
# NCCL_DEBUG=WARN: ncclGetErrorString says only "invalid usage"; NCCL's log line names the duplicate GPU.
export NCCL_DEBUG=WARN
worker=("$B/nq-worker" --host=127.0.0.1 --backend=cuda --gpu=0 --model="$M" --world_size=2 --tp_group=$group
        --leader_address=127.0.0.1:19100 --streamer_address=127.0.0.1:19200 --tp_timeout_s=30)
"${worker[@]}" --rank=0 --grpc_port=19100 --metrics_port=19101 >"$out/logs/rank0.log" 2>&1 &
leader=$!
timeout 180 "${worker[@]}" --rank=1 --metrics_port=19111 >"$out/logs/rank1.log" 2>&1
code=$?
sleep 2
if [[ $code -ne 0 && $code -ne 124 ]] && grep -q "refused by tensor-parallel group" "$out/logs/rank1.log" \
   && kill -0 $leader 2>/dev/null && grep -q "could not join the collectives' transport\|broken" "$out/logs/rank0.log"; then
  echo "== refusal: passed (rank 1 exit $code)"
  grep -m1 "refused by tensor-parallel group" "$out/logs/rank1.log" | cut -c1-400
  grep -m1 "could not join\|broken" "$out/logs/rank0.log" | cut -c1-400
else
  echo "== refusal: FAILED (rank 1 exit $code; rank 0 $(kill -0 $leader 2>/dev/null && echo alive || echo gone))"
  tail -5 "$out/logs/rank1.log"; tail -5 "$out/logs/rank0.log"; failed+=("refusal")
fi
grep -m2 "Duplicate GPU\|NCCL WARN" "$out/logs/rank1.log" | cut -c1-300
kill -TERM $leader 2>/dev/null; wait $leader 2>/dev/null
unset NCCL_DEBUG

echo "== 3. greedy tokens: CUDA decode graph (W = 1) against CPU shared memory (W = 2)"
# Streamer, workers and router for one configuration; writes the completions' texts to $2.
complete() {
  local name=$1 file=$2 base=$3
  shift 3
  local pids=()
  "$B/nq-streamer" --host=127.0.0.1 --grpc_port=$((base + 20)) --metrics_port=$((base + 21)) --records_dir="$M/release" \
    >"$out/logs/$name-streamer.log" 2>&1 &
  pids+=($!)
  local r=0
  for flags in "$@"; do
    # shellcheck disable=SC2086
    "$B/nq-worker" --host=127.0.0.1 --model="$M" --grpc_port=$((base + 10)) --leader_address=127.0.0.1:$((base + 10)) \
      --metrics_port=$((base + 30 + r)) --streamer_address=127.0.0.1:$((base + 20)) --tp_group=/nq-tp-$name-$$ $flags \
      >"$out/logs/$name-worker$r.log" 2>&1 &
    pids+=($!)
    r=$((r + 1))
  done
  "$B/nq-router" --host=127.0.0.1 --http_port=$base --grpc_port=$((base + 1)) --worker_address=127.0.0.1:$((base + 10)) \
    --tokenizer="$M/tokenizer.json" --chat_format=plain >"$out/logs/$name-router.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$base/health" >/dev/null && break; sleep 0.2; done
  : >"$file"
  for prompt in 'def fibonacci(n):' 'class Stack:' 'import os' 'for i in range(10):'; do
    curl -sf --max-time 120 "http://127.0.0.1:$base/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\":\"model\",\"prompt\":$(printf '%s' "$prompt" | python3 -c 'import json,sys;print(json.dumps(sys.stdin.read()))'),\"max_tokens\":64,\"temperature\":0,\"ignore_eos\":true}" \
      | python3 -c 'import json,sys;print(json.dumps(json.load(sys.stdin)["choices"][0]["text"]))' >>"$file" \
      || echo "REQUEST FAILED" >>"$file"
  done
  curl -sf "http://127.0.0.1:$((base + 30))/metrics" | grep -E "^nq_worker_tp_|step_graph" >"$out/logs/$name-metrics.txt"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  # Its own processes only: a bare `wait` also waits for the `exec > >(tee ...)` above (bash 5.1+),
  # which ends only with the script (the 2026-12-03 call hung here).
  wait "${pids[@]}" 2>/dev/null
}
complete cuda "$out/greedy_cuda.txt" 19300 "--backend=cuda --gpu=0 --step_graphs=true"
complete cpu2 "$out/greedy_cpu_w2.txt" 19400 "--backend=cpu --rank=0 --world_size=2" "--backend=cpu --rank=1 --world_size=2"
if cmp -s "$out/greedy_cuda.txt" "$out/greedy_cpu_w2.txt" && ! grep -q "REQUEST FAILED" "$out/greedy_cuda.txt"; then
  echo "== greedy: equal ($(wc -l <"$out/greedy_cuda.txt") completions of 64 tokens)"
else
  echo "== greedy: DIFFERENT"; diff "$out/greedy_cuda.txt" "$out/greedy_cpu_w2.txt" | head -10; failed+=("greedy")
fi
grep -h "step graphs\|graph" "$out/logs/cuda-worker0.log" | head -3

if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all passed"
