#!/usr/bin/env bash
# On the device: the DSA indexer's decode selection, the default filter + resolve path
# (indexer_decode_select.cuh) against the one-block candidate (indexer_one_block_select.cuh,
# IndexerDecodeSelect::kOneBlock); bench/README.md, "DSA indexer":
#   1. cuda_vs_cpu_ops_test: CudaIndexer* (exact selection against the CPU; the one-block path
#      against the default) and CudaStepPosition*, then compute-sanitizer memcheck
#      (NQ_MEMCHECK_FILTER) and racecheck (NQ_RACECHECK_FILTER);
#   2. indexer_bench, NQ_ROUNDS (2) times: each case through both selections, us per call and the
#      bytes it reads over the copy bandwidth of the run (every other bundled indexer_bench*, e.g.
#      a variant build, runs too);
#   3. ncu kernel durations at NQ_NCU_CASES (";"-separated indexer_bench --only names);
#   4. with NQ_SLICE (e.g. glm5:4:256:4000: make_slice.sh's arch, layers, experts, then the
#      context), that slice's decode tokens/s (BF16 matrices) for each bundled nq* binary (e.g. nq_filtered, an nq
#      built with IndexerDecodeSelect::kFiltered as the default), NQ_SLICE_ROUNDS (2) interleaved.
# NQ_TEST_FILTER replaces stage 1's gtest filter; stage 4 also checks that every build and round
# decoded the same greedy tokens. NQ_STAGES (default "tests bench ncu", add "slice") limits what runs. Results in $OUT (tests.txt,
# sanitize.txt, bench.txt, ncu.txt, slice_*.txt), a summary on stdout.
#
# Here (binaries and their libraries, xz-compressed; .devspec/ and .device3/ in .git/info/exclude):
#   cmake --build build/cuda --target cuda_vs_cpu_ops_test indexer_bench nq && mkdir -p .device3/bin .devspec
#   for b in tests/kernels/cuda_vs_cpu_ops_test tests/kernels/indexer_bench services/tools/nq; do
#     strip -o .device3/bin/$(basename $b) build/cuda/$b; done   # (nq: for the slice stage)
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/*
#   tar -C .device3 -cf - bin lib | xz -T0 -9 > .devspec/bundle.tar.xz && bash scripts/device/slim_tree.sh on cluster
# the `run` tool: carry [".devspec"], command: bash scripts/device/run_indexer_select.sh
set -uo pipefail
source "$(dirname "$0")/devspec_prelude.sh" /tmp/nq-devindexer
stages="${NQ_STAGES:-tests bench ncu}"
wants() { [[ " $stages " == *" $1 "* ]]; }
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if wants tests; then
  "$B/cuda_vs_cpu_ops_test" --gtest_filter="${NQ_TEST_FILTER:-CudaIndexer*:CudaStepPosition*}" >"$out/tests.txt" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran" "$out/tests.txt" | tail -15
fi
if wants tests && command -v compute-sanitizer >/dev/null; then
  {
    compute-sanitizer --tool memcheck "$B/cuda_vs_cpu_ops_test" \
      --gtest_filter="${NQ_MEMCHECK_FILTER:-CudaIndexerTopK.Tiny*:CudaIndexerOneBlock.Ties*:CudaIndexerOneBlock.Crowded*}"
    compute-sanitizer --tool racecheck "$B/cuda_vs_cpu_ops_test" \
      --gtest_filter="${NQ_RACECHECK_FILTER:-CudaIndexerTopK.Tiny*}"
    # The one-block kernel's barriers and shared appends on small rows (both row layouts).
    compute-sanitizer --tool racecheck "$B/cuda_vs_cpu_ops_test" --gtest_filter="${NQ_RACECHECK_ONE_BLOCK_FILTER:-CudaIndexerOneBlock.ADevicePosition*}"
  } >"$out/sanitize.txt" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitize.txt"
fi

for round in $(seq 1 "${NQ_ROUNDS:-2}"); do
  wants bench || break
  for bin in $(cd "$B" && ls indexer_bench*); do
    echo "== round $round: $bin" | tee -a "$out/bench.txt"
    timeout 120 "$B/$bin" 2>&1 | tee -a "$out/bench.txt" || status=1
  done
done

if wants ncu && command -v ncu >/dev/null; then
  IFS=';' read -r -a cases <<<"${NQ_NCU_CASES:-glm5 decode 4000;glm5 decode 16384;glm5 decode 131072;glm5 MTP 16384}"
  for c in "${cases[@]}"; do
    echo "== ncu: $c" | tee -a "$out/ncu.txt"
    # The first call of the case: the default path's scores, filter and resolve; then the first
    # one-block selection (its scores kernel is the same).
    for kernels in "regex:Indexer -c 3" "regex:IndexerOneBlock -c 1"; do
      # shellcheck disable=SC2086  # two ncu arguments in one word
      timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
        -k $kernels "$B/indexer_bench" --quick --only "$c" 2>&1 |
        grep -E "Indexer.*Kernel|duration|dram__|grid_size" | tee -a "$out/ncu.txt"
    done
  done
fi
if wants slice && [[ -n "${NQ_SLICE:-}" ]]; then
  make_bench_slice "$NQ_SLICE" /tmp/nq-indexer-slice "$out/make_slice.txt" || exit 1
  for round in $(seq 1 "${NQ_SLICE_ROUNDS:-2}"); do
    for bin in $(cd "$B" && ls nq*); do
      line=$(bench_slice "$bin" "$out/slice_${bin}_$round.txt") || status=1
      echo "== round $round, $bin, slice $NQ_SLICE: $line"
    done
  done
  # Every build and round must decode the same greedy tokens.
  compare_tokens "$out"/slice_*.json | tee "$out/slice_tokens.txt" || status=1
  rm -rf "$SLICE_DIR"
fi
exit "$status"
