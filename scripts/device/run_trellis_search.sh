#!/usr/bin/env bash
# One device call for the CUDA trellis search (issue #16), over the .gpu-cluster bundle:
#
#   cmake --build build/cuda --target cuda_trellis_search_test trellis_search_bench nq
#   NQ_NO_READ_BENCH=1 NQ_EXTRA_BINS="cuda_trellis_search_test=build/cuda/tests/kernels/cuda_trellis_search_test \
#     trellis_search_bench=build/cuda/tests/kernels/trellis_search_bench" bash scripts/device/package_cluster.sh
#   bash scripts/device/slim_tree.sh on cluster
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_trellis_search.sh"
#   bash scripts/device/slim_tree.sh off
#
# 1. cuda_trellis_search_test: every tile's symbols equal the CPU TileSearcher's, whole matrices
#    (with and without LDLQ) encode to the CPU's bytes, argument refusals; then compute-sanitizer
#    memcheck and racecheck over the small cases.
# 2. trellis_search_bench: tiles/s on the GPU and on every CPU core, and whole 2048 x 7168 and
#    7168 x 2048 (LDLQ) matrices encoded with the GPU search.
# 3. nq encode --codec trellis of glm5_nano with --device cuda, then nq verify; the same encode with
#    --device cpu (every core) beside it, and the two releases compared file by file.
# NQ_TRELLIS_NCU=1 adds ncu --set full over the search kernel (between 2 and 3).
# Results: $OUT/trellis_log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nq-trellis-search-out}"
mkdir -p "$out"
exec > >(tee "$out/trellis_log.txt") 2>&1
source scripts/device/unpack_cluster_bundle.sh  # sets $work
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv
nproc
B=$work/bin
M=$work/model
failed=()

echo "== 1. cuda_trellis_search_test"
timeout 300 "$B/cuda_trellis_search_test" || failed+=("cuda_trellis_search_test")
sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
if [[ -n "$sanitizer" ]]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    timeout 150 "$sanitizer" --tool "$tool" --error-exitcode 9 "$B/cuda_trellis_search_test" \
      --gtest_filter='CudaTrellisSearch.OneTile*' 2>&1 | tail -n 4 \
      || failed+=("$tool")
  done
else
  echo "compute-sanitizer not found"; failed+=("sanitizer missing")
fi

echo "== 2. trellis_search_bench"
timeout 400 "$B/trellis_search_bench" --tiles 66000 --cpu_tiles 512 || failed+=("trellis_search_bench")

# NQ_LDLQ_WORKERS=1,2,4,8: LDLQ encodes at once on the GPU, as nq encode --device cuda --workers W
# runs them (two 7168 x 2048 matrices a worker, about 150 s for that list); NQ_TRELLIS_SKIP_CPU=1
# leaves out section 3's CPU encode so both fit one call.
if [[ -n "${NQ_LDLQ_WORKERS:-}" ]]; then
  echo "== trellis_search_bench --ldlq_workers $NQ_LDLQ_WORKERS"
  timeout 400 "$B/trellis_search_bench" --tiles 1 --cpu_tiles 1 --skip_matrices --ldlq_workers "$NQ_LDLQ_WORKERS" \
    --ldlq_per_worker 2 | sed -n '/LDLQ encodes at once/,$p' || failed+=("trellis_search_bench --ldlq_workers")
fi

# NQ_TRELLIS_NCU=1: where a tile's search spends its time (ncu --set full over two launches of the
# search kernel on 2000 tiles): duration, issue slots, stall reasons, occupancy, shared memory.
if [[ "${NQ_TRELLIS_NCU:-0}" == 1 ]]; then
  echo "== ncu TrellisSearch"
  timeout 300 ncu --set full -k regex:Trellis --launch-count 2 "$B/trellis_search_bench" --tiles 2000 --cpu_tiles 1 \
    --skip_matrices > "$out/ncu_trellis.txt" 2>&1
  echo "ncu rc $?"
  grep -E "^  [A-Za-z].*(Kernel|kernel)|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Block Size|Grid Size|Cluster Size|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|One or More Eligible|Shared Memory Configuration Size|Executed Ipc|Stall" \
    "$out/ncu_trellis.txt" | head -80
  xz -9 "$out/ncu_trellis.txt"
fi

echo "== 3. nq encode --codec trellis of glm5_nano, --device cuda and --device cpu"
enc() {
  local device=$1
  local start=$SECONDS
  timeout 900 "$B/nq" encode --model="$M" --out="$work/release-$device" --codec=trellis --device="$device" 2>&1 \
    | grep -v "^\s*$" | tail -n 3
  echo "nq encode --device $device: $((SECONDS - start)) s"
}
enc cuda
"$B/nq" verify "$work/release-cuda" || failed+=("verify cuda release")
if [[ "${NQ_TRELLIS_SKIP_CPU:-0}" == 1 ]]; then
  echo "== the CPU encode skipped (NQ_TRELLIS_SKIP_CPU=1)"
elif enc cpu && diff -r "$work/release-cuda" "$work/release-cpu" >"$out/release_diff.txt" 2>&1; then
  echo "== releases: every file equal ($(find "$work/release-cuda" -type f | wc -l) files)"
else
  echo "== releases: DIFFERENT"; head -n 20 "$out/release_diff.txt"; failed+=("releases differ")
fi

# NQ_WITH_NCCL=1: the NCCL single-rank call (run_nccl_single_rank.sh, needs nccl_allreduce_bench
# in the bundle) in the same call; only its log comes back.
if [[ "${NQ_WITH_NCCL:-0}" == 1 ]]; then
  echo "== run_nccl_single_rank.sh"
  OUT="$work/nccl" bash scripts/device/run_nccl_single_rank.sh >/dev/null 2>&1 || failed+=("nccl single rank")
  cp "$work/nccl/nccl_log.txt" "$out/nccl_log.txt"
  tail -n 30 "$out/nccl_log.txt"
fi

if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all passed"
