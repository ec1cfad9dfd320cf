#!/usr/bin/env bash
# A W = 2 CPU tensor-parallel group of the embedded model (scripts/up.sh writes .run/embedded; NQ_MODEL=DIR
# for another), its control channel over shared memory and then TCP (--tp_control=tcp), alternated
# twice: 256 greedy tokens, three requests each (bench/README.md, "The control channel over TCP").
bin=build/cpu/services; model=${NQ_MODEL:-.run/embedded}; rel=$model/release_tp2
[[ -f $rel/COMPLETE ]] || $bin/tools/nq encode --model $model --out $rel --tp 2 --fixed-per-layer 4 >/dev/null
run() {
  local mode=$1; shift
  local pids=()
  $bin/streamer/nq-streamer --host=127.0.0.1 --records_dir=$rel >/tmp/tpb-s.log 2>&1 & pids+=($!)
  for r in 0 1; do
    $bin/worker/nq-worker --host=127.0.0.1 --backend=cpu --model=$model --release=$rel --rank=$r --world_size=2 \
      --leader_address=127.0.0.1:8100 --metrics_port=$((8101 + 10 * r)) --grpc_port=$((8100 + 20 * r)) "$@" >/tmp/tpb-w$r.log 2>&1 & pids+=($!)
  done
  $bin/router/nq-router --host=127.0.0.1 --tokenizer=$model/tokenizer.json --chat_format=plain >/tmp/tpb-r.log 2>&1 & pids+=($!)
  for i in $(seq 1 200); do curl -sf localhost:8000/v1/models | grep -q embedded && break; sleep 0.3; done
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model":"embedded","prompt":"def f(","max_tokens":16,"temperature":0}' >/dev/null
  for k in 1 2 3; do
    local t0=$(date +%s.%N)
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model":"embedded","prompt":"import os\nclass Config:","max_tokens":256,"temperature":0,"ignore_eos":true}' > /tmp/tpb-out.json
    local t1=$(date +%s.%N)
    echo "$mode run $k: $(python3 -c "import json;d=json.load(open('/tmp/tpb-out.json'));print(d['usage']['completion_tokens'])") tokens in $(python3 -c "print(round($t1-$t0,3))") s"
  done
  for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null; done; wait 2>/dev/null
}
run shm
run tcp --tp_control=tcp
run shm
run tcp --tp_control=tcp
