#!/usr/bin/env bash
# One device call for side work (Backend::BeginSideWork, issue #13): over the .gpu-cluster bundle
# (scripts/device/package_cluster.sh with NQ_EXTRA_BINS="cuda_vs_cpu_ops_test=..."), .hbm carried:
#  - CudaSideWork* (side and main streams, eagerly and in a graph; memory held to the join; the
#    refusals) and CudaStepPosition*, plain and under compute-sanitizer memcheck;
#  - memcheck over real graph replays with side streams (nq bench-decode on glm5_nano, 8 steps);
#  - glm5_nano's greedy tokens (300-token prompt, so DSA selects): side streams on and off, graphs
#    on and off, against the CPU backend's;
#  - the cluster's greedy check (CUDA worker against a CPU worker, 2 and 4 bits, fixed set);
#  - the GLM-5 target slice (4 layers, 256 experts, context 4000; NQ_SLICES="arch:layers:experts:context
#    ..." for others, e.g. "dsv3:4:32:32"): tokens/s and roofline ratio with side streams on and off,
#    interleaved over NQ_ROUNDS rounds (default 3), equal tokens checked; NQ_WEIGHT_DTYPE (default
#    bf16) the slice's matrices;
#  - glm5_nano with NVFP4 experts (nq nvfp4 quantize): greedy tokens in step graphs, op by op and
#    on the CPU backend;
#  - hbm_probe's yardsticks in the same call.
# NQ_ONLY=ops,nano,greedy,slice,nvfp4,hbm (comma list) limits what runs.
#
#   run tool: carry [".gpu-cluster", ".hbm"], command "bash scripts/device/run_side_streams.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-side-streams-out}"
mkdir -p "$OUT"
only="${NQ_ONLY:-ops,nano,greedy,slice,nvfp4,hbm}"
wants() { [[ ",$only," == *",$1,"* ]]; }
stamp() { echo "-- $(date +%T) $*"; }
source scripts/device/unpack_cluster_bundle.sh  # $work, LD_LIBRARY_PATH
B=$work/bin
M=$work/model

source scripts/device/compare_tokens.sh  # compare_tokens

if wants ops; then
  stamp ops
  $B/cuda_vs_cpu_ops_test --gtest_filter='CudaSideWork*:CudaStepPosition*' > $OUT/ops.txt 2>&1; echo "== ops rc $?"
  grep -E "^\[  (PASSED|FAILED)|FAILED|Failure" $OUT/ops.txt | head -20
  compute-sanitizer --tool memcheck $B/cuda_vs_cpu_ops_test --gtest_filter='CudaSideWork*' > $OUT/memcheck.txt 2>&1
  echo "== memcheck CudaSideWork* rc $?"; tail -2 $OUT/memcheck.txt
  compute-sanitizer --tool memcheck $B/nq bench-decode --model=$M --release=$M/release --expert-bits=2 --backend=cuda \
    --decode-tokens=8 --warmup=2 --prompt-tokens=100 --copy_mb=0 > $OUT/memcheck_bench.txt 2>&1
  echo "== memcheck bench-decode (graphs, side streams) rc $?"; tail -3 $OUT/memcheck_bench.txt
fi

if wants nano; then
  stamp nano
  runs=()
  for run in "cpu true true" "cuda true true" "cuda false true" "cuda true false" "cuda false false"; do
    read -r backend side graphs <<<"$run"
    name="/tmp/nano_${backend}_side-${side}_graphs-${graphs}.json"
    $B/nq bench-decode --model=$M --release=$M/release --expert-bits=2 --backend=$backend --prompt-tokens=300 \
      --decode-tokens=128 --warmup=2 --copy_mb=0 --side_streams=$side --step_graphs=$graphs --out=$name \
      > /tmp/nano.log 2>&1 || { echo "$run failed"; tail -3 /tmp/nano.log; }
    echo "$run: $(tail -1 /tmp/nano.log | sed 's/.*: //')"
    runs+=("$name")
  done
  compare_tokens "${runs[@]}" | tee $OUT/nano_tokens.txt
fi

if wants greedy; then
  stamp greedy
  python3 scripts/device/gpu_cluster_check.py --bin $B --model $M --out /tmp/g1 --only greedy > /tmp/g1.txt 2>&1
  echo "== cluster greedy rc $?"
  python3 -c "
import json;r=json.load(open('/tmp/g1/gpu_cluster.json'))['greedy']
for b,v in r['by_bits'].items(): print(' ', b, 'equal', v['equal'], v['per_prompt_equal'])" > $OUT/greedy.txt 2>&1
  cat $OUT/greedy.txt; tail -3 /tmp/g1.txt
fi

if wants slice; then
  for spec in ${NQ_SLICES:-glm5:4:256:4000}; do
    IFS=: read -r arch layers experts context <<<"$spec"
    stamp "slice $spec"
    slice=/tmp/nq_slice_$arch
    rm -rf "$slice"
    if ! NQ="$B/nq" bash scripts/device/make_slice.sh "$arch" "$slice" "$layers" "$experts" 0 > /tmp/make_slice.log 2>&1; then
      echo "make_slice $spec failed"; tail -5 /tmp/make_slice.log; rm -rf "$slice"; continue
    fi
    stamp "slice made"
    for round in $(seq 1 "${NQ_ROUNDS:-3}"); do
      for side in true false; do
        $B/nq bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
          --prompt-tokens="$context" --decode-tokens=64 --warmup=4 --weight-dtype="${NQ_WEIGHT_DTYPE:-bf16}" --side_streams=$side \
          --out=/tmp/slice_side-$side.json > /tmp/slice.log 2>&1 || { echo "slice $side failed"; tail -3 /tmp/slice.log; }
        echo "== round $round slice $spec ${NQ_WEIGHT_DTYPE:-bf16} side_streams=$side: $(tail -1 /tmp/slice.log | sed 's/.*H200[^:]*: //')"
      done
    done
    compare_tokens /tmp/slice_side-false.json /tmp/slice_side-true.json | tee -a $OUT/slice_tokens.txt
    rm -rf "$slice"
  done
fi

# NVFP4 experts in step graphs (issue #20): glm5_nano's experts quantized to NVFP4 here, then
# bench-decode's greedy tokens in graphs, op by op, and on the CPU backend (all must be equal).
if wants nvfp4; then
  stamp nvfp4
  if $B/nq nvfp4 quantize --model=$M --out=/tmp/nano_nvfp4 > /tmp/nvfp4_quantize.log 2>&1; then
    runs=()
    for run in "cpu true" "cuda true" "cuda false"; do
      read -r backend graphs <<<"$run"
      name="/tmp/nvfp4_${backend}_graphs-${graphs}.json"
      $B/nq bench-decode --model=/tmp/nano_nvfp4 --backend=$backend --prompt-tokens=300 --decode-tokens=128 \
        --warmup=2 --copy_mb=0 --step_graphs=$graphs --out=$name > /tmp/nvfp4.log 2>&1 ||
        { echo "nvfp4 $run failed"; tail -3 /tmp/nvfp4.log; }
      echo "nvfp4 $run: $(grep -m1 'step graphs' /tmp/nvfp4.log) $(tail -1 /tmp/nvfp4.log | sed 's/.*: //')"
      runs+=("$name")
    done
    compare_tokens "${runs[@]}" | tee $OUT/nvfp4_tokens.txt
  else
    echo "nq nvfp4 quantize failed"; tail -5 /tmp/nvfp4_quantize.log
  fi
fi

if wants hbm && [[ -f .hbm/hbm_probe.py ]]; then
  stamp hbm
  python3 .hbm/hbm_probe.py > "$OUT/hbm.txt" 2>&1; echo "== hbm_probe rc $?"; tail -12 "$OUT/hbm.txt"
fi
stamp done
