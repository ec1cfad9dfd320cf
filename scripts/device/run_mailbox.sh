#!/usr/bin/env bash
# One device call for the in-graph slot mailbox (issue #14) and the device's predictor norms (issue
# #21), over the .gpu-cluster bundle (scripts/device/package_cluster.sh with NQ_EXTRA_BINS=
# "cuda_vs_cpu_ops_test=... decode_bench_test=..."), .hbm carried:
#  - cluster: scripts/device/run_gpu_cluster.sh on glm5_nano (the CUDA worker takes its slot changes
#    through the mailbox: --slot_mailbox auto), with CudaSlotMailbox* and CudaSideWork* plain and
#    under memcheck; the worker log must show the mailbox in use and no refused update;
#  - norms: decode_bench_test's DecodeStepsReportTheInputNormsTheHostComputes with the stepped model
#    on the GPU (NQ_STEPPED_BACKEND=cuda), the CPU's whole forward its oracle; and its
#    ASlotMailboxDecidesTheBitsOfEveryForwardInsideCapturedSteps (posted rows reach replayed graphs);
#  NQ_CLUSTER_SLICE=1 adds the GLM-5-shaped slice's cluster run;
#  - cost: nq bench-decode with --slot_mailbox on and off (an idle mailbox applied in every MoE block),
#    interleaved over NQ_ROUNDS rounds, on glm5_nano and the GLM-5 slice (NQ_SLICES, default
#    glm5:4:256:4000), tokens compared;
#  - hbm_probe's yardsticks.
#  - ops: CudaSlotMailbox* alone (the cluster section runs them too, with memcheck).
# NQ_ONLY=cluster,ops,norms,cost,hbm limits what runs (default: all but ops).
#
#   run tool: carry [".gpu-cluster", ".hbm"], command "bash scripts/device/run_mailbox.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-mailbox-out}"
mkdir -p "$OUT"
only="${NQ_ONLY:-cluster,norms,cost,hbm}"
wants() { [[ ",$only," == *",$1,"* ]]; }
stamp() { echo "-- $(date +%T) $*"; }

if wants cluster; then
  stamp cluster
  OUT="$OUT/cluster" NQ_SLICE="${NQ_CLUSTER_SLICE:-0}" NQ_READ_BENCH=0 NQ_NSYS=0 NQ_GTEST_FILTER='CudaSlotMailbox*:CudaSideWork*' \
    bash scripts/device/run_gpu_cluster.sh > "$OUT/cluster.txt" 2>&1
  echo "== cluster rc $?"
  grep -E "^== |PASSED|FAILED|passed|failed|mailbox" "$OUT/cluster.txt" | head -60
  # The services' logs travel as one archive: the mailbox must have been in use, nothing refused.
  mkdir -p /tmp/cluster_logs && tar -C /tmp/cluster_logs -xzf "$OUT/cluster/logs.tar.gz" 2>/dev/null
  echo "== services' logs: mailbox lines, refused or rejected updates, integrity"
  grep -rhoE "slot mailbox [^:]*: slot-table changes apply inside decode steps|changes posted to its slot mailbox|changes sent in updates|refused|rejected|integrity[^,]*" /tmp/cluster_logs | sed 's|/nq-mailbox[^:]*|/nq-mailbox-...|' | sort | uniq -c | head -20
  python3 - "$OUT/cluster/gpu_cluster.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ('streaming', 'streamer_kill', 'stress'):
    v = r.get(k)
    print(f'== {k}:', json.dumps(v)[:600] if v is not None else None)
PY
  # The run tool returns a bounded number of files: keep the summaries, drop the rest.
  rm -rf "$OUT/cluster/logs.tar.gz" "$OUT"/cluster/bench_decode_*.json
fi

source scripts/device/unpack_cluster_bundle.sh  # $work, LD_LIBRARY_PATH
B=$work/bin
M=$work/model

if wants ops; then
  stamp ops
  $B/cuda_vs_cpu_ops_test --gtest_filter='CudaSlotMailbox*' > "$OUT/ops.txt" 2>&1
  echo "== CudaSlotMailbox* rc $?"; grep -E "^\[  |Failure" "$OUT/ops.txt" | head -12
fi

if wants norms && [[ -x $B/decode_bench_test ]]; then
  stamp norms
  # The test finds glm5_nano where it was built (NQ_SOURCE_DIR = /work/main); the slimmed tree
  # lacks its weights, the bundle carries them.
  if [[ ! -e /work/main/models/glm5_nano/model.safetensors ]]; then
    mkdir -p /work/main/models/glm5_nano
    for f in "$M"/*; do [[ -e /work/main/models/glm5_nano/$(basename "$f") ]] || ln -s "$f" /work/main/models/glm5_nano/; done
  fi
  NQ_STEPPED_BACKEND=cuda $B/decode_bench_test --gtest_filter='*InputNorms*:*SlotMailbox*' > "$OUT/norms.txt" 2>&1
  echo "== norms and the model's mailbox on the GPU rc $?"; grep -E "^\[  |Failure|Expected|Which is|forward" "$OUT/norms.txt" | head -20
fi

source scripts/device/compare_tokens.sh  # compare_tokens

if wants cost; then
  stamp "cost nano"
  for round in $(seq 1 "${NQ_ROUNDS:-3}"); do
    # Off first in odd rounds, on first in even ones: the order must not pass for a cost.
    order="false true"; (( round % 2 == 0 )) && order="true false"
    for mb in $order; do
      $B/nq bench-decode --model=$M --release=$M/release --expert-bits=2 --backend=cuda --prompt-tokens=300 \
        --decode-tokens=256 --warmup=4 --slot_mailbox=$mb --out=/tmp/nano_mailbox-$mb.json > /tmp/nano.log 2>&1 ||
        { echo "nano $mb failed"; tail -3 /tmp/nano.log; }
      echo "== round $round nano slot_mailbox=$mb: $(tail -1 /tmp/nano.log | sed 's/.*H200[^:]*: //')"
    done
  done
  compare_tokens /tmp/nano_mailbox-false.json /tmp/nano_mailbox-true.json | tee "$OUT/nano_tokens.txt"
  for spec in ${NQ_SLICES:-glm5:4:256:4000}; do
    IFS=: read -r arch layers experts context <<<"$spec"
    stamp "slice $spec"
    slice=/tmp/nq_slice_$arch
    rm -rf "$slice"
    if ! NQ="$B/nq" bash scripts/device/make_slice.sh "$arch" "$slice" "$layers" "$experts" 0 > /tmp/make_slice.log 2>&1; then
      echo "make_slice $spec failed"; tail -5 /tmp/make_slice.log; rm -rf "$slice"; continue
    fi
    for round in $(seq 1 "${NQ_ROUNDS:-3}"); do
      order="false true"; (( round % 2 == 0 )) && order="true false"
      for mb in $order; do
        $B/nq bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
          --prompt-tokens="$context" --decode-tokens=64 --warmup=4 --weight-dtype=bf16 --slot_mailbox=$mb \
          --out=/tmp/slice_mailbox-$mb.json > /tmp/slice.log 2>&1 || { echo "slice $mb failed"; tail -3 /tmp/slice.log; }
        echo "== round $round slice $spec slot_mailbox=$mb: $(tail -1 /tmp/slice.log | sed 's/.*H200[^:]*: //')"
      done
    done
    compare_tokens /tmp/slice_mailbox-false.json /tmp/slice_mailbox-true.json | tee -a "$OUT/slice_tokens.txt"
    rm -rf "$slice"
  done
fi

if wants hbm && [[ -f .hbm/hbm_probe.py ]]; then
  stamp hbm
  python3 .hbm/hbm_probe.py > "$OUT/hbm.txt" 2>&1; echo "== hbm_probe rc $?"; tail -12 "$OUT/hbm.txt"
fi
stamp done
