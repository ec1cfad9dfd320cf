#!/usr/bin/env bash
# One device call for MTP drafts chained on the GPU (issue #15: Model::DraftOnDevice, on by
# default through nq-worker's --device_sampling), over the .gpu-cluster bundle
# (scripts/device/package_cluster.sh with NQ_EXTRA_BINS="decode_bench_test=..."), .hbm carried:
#  - ops: decode_bench_test's DraftsChainedOnTheSteppedBackendAreItsHostDrafts on the GPU
#    (NQ_STEPPED_BACKEND=cuda: the chain captured and replayed against the host's chain), plain
#    and under compute-sanitizer memcheck;
#  - spec: the cluster's MTP check on glm5_nano (gpu_cluster_check.py --only spec), drafts chained
#    on the GPU (the default) and drawn on the host (--device_sampling=false) in alternating
#    order, N = 0 and 3, NQ_ROUNDS rounds; then N = 0, 1, 2, 3 with the default;
#  - slice: the same two ways on the GLM-5-shaped slice (2 layers + MTP, 16 experts), N = 0 and 3:
#    the speculative step's time over a plain one;
#  - hbm_probe's yardsticks.
# NQ_ONLY=ops,spec,slice,hbm limits what runs (default: all).
#
#   run tool: carry [".gpu-cluster", ".hbm"], command "bash scripts/device/run_spec_drafts.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-spec-out}"
mkdir -p "$OUT"
only="${NQ_ONLY:-ops,spec,slice,hbm}"
wants() { [[ ",$only," == *",$1,"* ]]; }
stamp() { echo "-- $(date +%T) $*"; }

source scripts/device/unpack_cluster_bundle.sh  # $work, LD_LIBRARY_PATH
B=$work/bin

# The compact line of one spec check: per N, tokens/s, step ms, tokens a step, acceptance per
# draft position; and whether greedy output equalled N = 0's.
summarise() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])).get("spec", {})
for n, row in sorted(r.get("by_drafts", {}).items(), key=lambda kv: int(kv[0])):
    acc = ", ".join(f"{a:.2f}" for a in row.get("accepted_per_position") or [])
    tps = row.get("tokens_per_s") or 0
    step = row.get("step_ms_mean") or 0
    tpst = row.get("tokens_per_step") or 0
    print(f"== {sys.argv[2]} N={n}: {tps:.1f} tokens/s, step {step:.3f} ms, {tpst:.2f} tokens/step, "
          f"accepted per position [{acc}], greedy equal {row.get('greedy_equal_to_first')}, error {row.get('error')}")
print(f"== {sys.argv[2]} pass {r.get('pass')}")
PY
}

if wants ops; then
  stamp ops
  NQ_STEPPED_BACKEND=cuda $B/decode_bench_test --gtest_filter='*DraftsChained*' > "$OUT/ops.txt" 2>&1
  echo "== DraftsChained on the GPU rc $?"; grep -E "^\[  |Failure|Expected|Which is" "$OUT/ops.txt" | head -20
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  if [[ -n "$sanitizer" ]]; then
    NQ_STEPPED_BACKEND=cuda timeout 300 "$sanitizer" --tool memcheck --error-exitcode 9 \
      $B/decode_bench_test --gtest_filter='*DraftsChained*' > "$OUT/ops_memcheck.txt" 2>&1
    echo "== memcheck rc $?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/ops_memcheck.txt" | head -5
  fi
fi

if wants spec; then
  for round in $(seq 1 "${NQ_ROUNDS:-2}"); do
    # Alternate which goes first.
    order=("device" "host"); (( round % 2 == 0 )) && order=("host" "device")
    for mode in "${order[@]}"; do
      flags=""; [[ $mode == host ]] && flags="--device_sampling=false"
      stamp "spec $mode round $round"
      python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$work/model" --out "$OUT/spec_${mode}_$round" \
        --backend cuda --only spec --spec-drafts 0,3 --spec-worker-flags "$flags" > "$OUT/spec_${mode}_$round.txt" 2>&1
      summarise "$OUT/spec_${mode}_$round/gpu_cluster.json" "drafts on the $mode, round $round"
      rm -rf "$OUT/spec_${mode}_$round/logs"
    done
  done
  stamp "spec device N=0..3"
  python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$work/model" --out "$OUT/spec_all" \
    --backend cuda --only spec > "$OUT/spec_all.txt" 2>&1
  summarise "$OUT/spec_all/gpu_cluster.json" "drafts on the device"
  rm -rf "$OUT/spec_all/logs"
fi

if wants slice; then
  stamp slice
  slice=/tmp/nq_glm5_slice
  if NQ="$B/nq" bash scripts/device/make_slice.sh glm5 "$slice" 2 16 1 > "$OUT/make_slice.log" 2>&1; then
    for mode in device host; do
      flags=""; [[ $mode == host ]] && flags="--device_sampling=false"
      python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$slice" --out "$OUT/slice_$mode" \
        --backend cuda --only spec --decode-tokens 128 --spec-drafts 0,3 --spec-worker-flags "$flags" \
        > "$OUT/slice_$mode.txt" 2>&1
      summarise "$OUT/slice_$mode/gpu_cluster.json" "slice, drafts on the $mode"
      rm -rf "$OUT/slice_$mode/logs"
    done
  else
    tail -5 "$OUT/make_slice.log"
  fi
  rm -rf "$slice"
fi

if wants hbm && [[ -f .hbm/hbm_probe.py ]]; then
  stamp hbm
  python3 .hbm/hbm_probe.py > "$OUT/hbm.txt" 2>&1
  echo "== hbm_probe rc $?"; cat "$OUT/hbm.txt"
fi
stamp done
