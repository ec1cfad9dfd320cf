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
#    and nq bench-decode --spec_drafts 3 (a plain forward, the 1 + 3 verification, the drafts
#    chained and through the host, timed apart);
#  - slice: the same two ways on the GLM-5-shaped slice (2 layers + MTP, 16 experts), N = 0 and 3,
#    and bench-decode's spec step at contexts 16 and 4000;
#  - hbm_probe's yardsticks.
#  - bench: bench-decode's spec step alone on glm5_nano and the slice (not in the default list).
# NQ_ONLY=ops,spec,slice,hbm,bench limits what runs (default: ops,spec,slice,hbm).
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

# bench-decode's spec step (a plain forward, the 1 + 3 verification, the drafts chained from one
# and from four kept rows, and through the host, timed apart): glm5_nano twice, a slice per context.
bench_nano() {
  stamp "bench-decode spec step, nano"
  for round in 1 2; do
    "$B/nq" bench-decode --model="$work/model" --release="$work/model/release" --expert-bits=fixed --backend=cuda \
      --prompt-tokens=300 --decode-tokens=64 --warmup=4 --spec_drafts=3 --spec_rounds=50 2>&1 | grep -E "spec step|tokens/s"
  done
}
bench_slice() {
  for context in ${NQ_SLICE_CONTEXTS:-16 4000}; do
    "$B/nq" bench-decode --model="$1" --release="$1/release" --expert-bits=2 --backend=cuda \
      --prompt-tokens=$context --decode-tokens=32 --warmup=4 --weight-dtype=bf16 --spec_drafts=3 --spec_rounds=30 \
      2>&1 | grep -E "spec step|tokens/s"
  done
}

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
    draft = row.get("draft_ms_mean") or 0
    print(f"== {sys.argv[2]} N={n}: {tps:.1f} tokens/s, step {step:.3f} ms (drafting {draft:.3f}), {tpst:.2f} tokens/step, "
          f"accepted per position [{acc}], greedy equal {row.get('greedy_equal_to_first')}, error {row.get('error')}")
    buckets = row.get("draft_steps_at_most_ms") or {}
    if buckets:
        print("   drafting steps at most (ms): " + ", ".join(f"{k}: {v:g}" for k, v in buckets.items() if v))
    if row.get("step_graph_events"):
        print("   step graphs over the request: " + ", ".join(f"{k} {v:g}" for k, v in row["step_graph_events"].items()))
print(f"== {sys.argv[2]} pass {r.get('pass')}")
if not r.get("pass"):
    rows = r.get("by_drafts", {})
    base = rows.get("0", {}).get("greedy_texts") or []
    for n, row in rows.items():
        for i, (a, b) in enumerate(zip(base, row.get("greedy_texts") or [])):
            if a != b:
                at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                print(f"   N={n} prompt {i} differs from N=0 at character {at}: {a[max(0, at - 20):at + 40]!r} vs {b[max(0, at - 20):at + 40]!r}")
PY
}

# One spec check: its summary; its files kept only when it failed.
spec_check() {  # model out label flags [extra args]
  local model=$1 out=$2 label=$3 flags=$4; shift 4
  python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$model" --out "$out" --backend cuda --only spec \
    --spec-worker-flags="$flags" "$@" > "$out.txt" 2>&1
  summarise "$out/gpu_cluster.json" "$label"
  if grep -q '"pass": true' "$out/gpu_cluster.json" 2>/dev/null; then
    rm -rf "$out" "$out.txt"
  else
    grep -rhE "WARN|ERROR|\] [EW] |failed|INVALID|INTERNAL" "$out/logs" 2>/dev/null | sort | uniq -c | sort -rn | head -12
    rm -rf "$out/logs"
  fi
}

if wants ops; then
  stamp ops
  # The test finds glm5_nano where it was built (NQ_SOURCE_DIR = /work/main); the slimmed tree
  # lacks its weights, the bundle carries them.
  if [[ ! -e /work/main/models/glm5_nano/model.safetensors ]]; then
    mkdir -p /work/main/models/glm5_nano
    for f in "$work"/model/*; do
      [[ -e /work/main/models/glm5_nano/$(basename "$f") ]] || ln -s "$f" /work/main/models/glm5_nano/
    done
  fi
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
      spec_check "$work/model" "$OUT/spec_${mode}_$round" "drafts on the $mode, round $round" "$flags" --spec-drafts 0,3
    done
  done
  stamp "spec device N=0..3"
  spec_check "$work/model" "$OUT/spec_all" "drafts on the device" ""
  bench_nano
fi

# bench: bench-decode's spec step alone, glm5_nano and the slice (no cluster runs).
if wants bench; then
  bench_nano
  stamp "bench slice"
  slice=/tmp/nq_glm5_slice
  if NQ="$B/nq" bash scripts/device/make_slice.sh glm5 "$slice" 2 16 1 > "$OUT/make_slice.log" 2>&1; then
    bench_slice "$slice"
  else
    tail -5 "$OUT/make_slice.log"
  fi
  rm -rf "$slice"
fi

if wants slice; then
  stamp slice
  slice=/tmp/nq_glm5_slice
  if NQ="$B/nq" bash scripts/device/make_slice.sh glm5 "$slice" 2 16 1 > "$OUT/make_slice.log" 2>&1; then
    for mode in ${NQ_SLICE_MODES:-device host}; do
      flags=""; [[ $mode == host ]] && flags="--device_sampling=false"
      spec_check "$slice" "$OUT/slice_$mode" "slice, drafts on the $mode" "$flags" --decode-tokens 128 --spec-drafts 0,3
    done
    bench_slice "$slice"
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
