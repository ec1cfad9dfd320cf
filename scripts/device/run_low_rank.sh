#!/usr/bin/env bash
# Low-rank corrections on the GPU (issue #16; kernels/cuda/nq_moe_low_rank.cuh), in one device call
# over the cluster bundle:
#   cmake --build build/cuda --target nq nq-worker nq-router nq-streamer cuda_vs_cpu_ops_test nq_moe_bench
#   NQ_NO_READ_BENCH=1 NQ_EXTRA_BINS="cuda_vs_cpu_ops_test=build/cuda/tests/kernels/cuda_vs_cpu_ops_test \
#     nq_moe_bench=build/cuda/tests/kernels/nq_moe_bench" bash scripts/device/package_cluster.sh
#   bash scripts/device/make_low_rank_release.sh   # .lr/: glm5_nano's release with --lowrank_rank 2
#                                                  # and the CPU backend's tokens on it and without
#   mkdir -p .hbm && cp ../shared/tools/hbm_probe.py .hbm/ && bash scripts/device/slim_tree.sh on cluster
#   run tool: carry [".gpu-cluster", ".hbm", ".lr"], command "bash scripts/device/run_low_rank.sh"
#   bash scripts/device/slim_tree.sh off
# $OUT gets log.txt and the four token files only (the tool brings back a limited number of files).
# Order = priority: the op against the CPU on every path, the decode and prefill blocks with and
# without factors side by side, the release served on the GPU against the CPU's tokens, sanitizer.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/low_rank}"; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$SECONDS
stamp() { echo "-- $(date +%T) +$((SECONDS - t0))s $*"; }
left() { (( SECONDS - t0 < $1 )); }
source scripts/device/unpack_cluster_bundle.sh  # $work, LD_LIBRARY_PATH
B=$work/bin
source scripts/device/compare_tokens.sh
nvidia-smi -L
stamp "op tests"
$B/cuda_vs_cpu_ops_test --gtest_filter='CudaNqMoeLowRank*:CudaNqMoe.*' 2>&1 | grep -E "compare|PASSED|FAILED|Failure|Expected|Which is|trace|error" | head -60
stamp "bench: decode without and with rank-4 factors on every expert"
for round in 1 2; do
  for r in 0 4; do
    echo "== round $round lowrank $r"; $B/nq_moe_bench --quick --codec=scalar --lowrank=$r | grep -E "copy:|T=" 
  done
done
stamp "bench: prefill (DeepSeek-V3, scalar)"
if left 300; then
  for r in 0 4; do echo "== prefill lowrank $r"; timeout 100 $B/nq_moe_bench --model=dsv3 --codec=scalar --lowrank=$r | grep -E "grouped|dense"; done
fi
stamp "release served on the GPU"
rel=/tmp/lr_release; mkdir -p "$rel" && tar -C "$rel" -xf .lr/release.tar
M=$work/model
for bits in 2 4; do
  for r in lr plain; do
    release=$rel; [[ $r == plain ]] && release=$M/release
    $B/nq bench-decode --model=$M --release=$release --expert-bits=$bits --backend=cuda --decode-tokens=256 \
      --prompt-tokens=128 --warmup=2 --out=$OUT/cuda_${r}_$bits.json > /tmp/cuda_${r}_$bits.log 2>&1
    echo "== cuda $r bits $bits rc=$?: $(tail -1 /tmp/cuda_${r}_$bits.log)"
  done
  echo "-- against the CPU's tokens with the corrections (.lr/cpu_lr_$bits.json):"
  compare_tokens .lr/cpu_lr_$bits.json $OUT/cuda_lr_$bits.json .lr/cpu_plain_$bits.json
  echo "-- against the CPU's tokens without (.lr/cpu_plain_$bits.json):"
  compare_tokens .lr/cpu_plain_$bits.json $OUT/cuda_plain_$bits.json $OUT/cuda_lr_$bits.json
done
[[ -f .hbm/hbm_probe.py ]] && left 420 && { stamp hbm; python3 .hbm/hbm_probe.py 2>&1 | head -4; }
stamp sanitizer
if left 450; then
  NQ_SANITIZE_SMALL=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 $B/cuda_vs_cpu_ops_test \
    --gtest_filter='CudaNqMoeLowRank*' --gtest_brief=1 2>&1 | tail -3; echo "memcheck rc=${PIPESTATUS[0]}"
fi
stamp "#23: a layer-major prefill with 4 own slots, borrowing room from the free KV cache or not"
if left 470; then
  for borrow in true false true false; do
    $B/nq bench-prefill --model=$M --release=$M/release --backend=cuda --expert_bits=2 --prefill_lengths=1536 \
      --prefill_rounds=2 --prefill_chunk_tokens=512 --layer_major_prefill_tokens=1024 --prefill_expert_slots=4 \
      --prefill_full_span_tokens=1536 --max_model_len=4096 --prefill_borrow_kv=$borrow > /tmp/borrow.log 2>&1
    echo "== borrow=$borrow rc=$?"; grep -vE "^\s*$" /tmp/borrow.log | tail -3
  done
fi
if left 520; then
  NQ_SANITIZE_SMALL=1 timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 $B/cuda_vs_cpu_ops_test \
    --gtest_filter='CudaNqMoeLowRank*' --gtest_brief=1 2>&1 | tail -3; echo "racecheck rc=${PIPESTATUS[0]}"
fi
stamp done
