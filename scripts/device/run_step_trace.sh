#!/usr/bin/env bash
# On the device: where a graphed decode step's time goes, and a build against an earlier one
# (bench/README.md, "The decode step as it runs"):
#   1. cuda_vs_cpu_ops_test CudaMoeRoute* and CudaSideWork* (the routing kernel against the CPU,
#      the side stream's ordering and its host copies), then compute-sanitizer memcheck of them;
#   2. the GLM-5 slice (NQ_SLICE, default glm5:4:256:4000) decoded by nq under
#      libnq_kernel_trace.so, and kernel_trace_table.py's table and timeline of its steps;
#   3. the slice timed by nq, the bundle's nq_before (an nq of an earlier commit) if it has one, and
#      any other nq_NAME it holds (variants), NQ_ROUNDS (2) rounds interleaved, NQ_SLICE_FLAGS added
#      to every run (e.g. --kv-cache-dtype=bf16), the same greedy tokens in every run (checked);
#   4. with NQ_SLICE2 (e.g. dsv3:4:32:32), step 3 again on that slice.
# NQ_FLAG_VARIANTS adds runs of the bundle's nq with flags of their own, as variants beside the
# builds: space-separated NAME=FLAG[,FLAG...] (e.g. "noside=--side_streams=false
# plain=--side_streams=false,--fused_residual_norm=false"; the same tokens are checked for them).
# NQ_TESTS=0 skips step 1 (a bundle without cuda_vs_cpu_ops_test), NQ_TRACE=0 step 2;
# NQ_TEST_FILTER replaces step 1's test filter (memcheck runs the same tests less *Timing). A
# graph_launch_bench in the bundle runs first (graph_launch.txt: what each graph feature costs a
# replay, beside the slices).
# Results in $OUT (tests.txt, memcheck.txt, trace_table.txt, trace.csv.xz, slice_*.txt / .json).
#
# Here (binaries and libraries xz-compressed; .devspec/ and .device3/ in .git/info/exclude):
#   cmake --build build/cuda --target nq cuda_vs_cpu_ops_test nq_kernel_trace && mkdir -p .device3/bin .devspec
#   strip -o .device3/bin/nq build/cuda/services/tools/nq
#   strip -o .device3/bin/cuda_vs_cpu_ops_test build/cuda/tests/kernels/cuda_vs_cpu_ops_test
#   (optional: strip -o .device3/bin/nq_before an nq built at an earlier commit)
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/*
#   cp build/cuda/tests/kernels/libnq_kernel_trace.so .device3/lib/ && cp -L /usr/local/cuda/lib/libcupti.so.13 .device3/lib/
#   tar -C .device3 -cf - bin lib | xz -T1 -9 > .devspec/bundle.tar.xz && bash scripts/device/slim_tree.sh on cluster
#   (one xz thread at -9: its dictionary spans the builds, so five nq variants pack into 24 MB, not
#   the 56 MB of threaded blocks, and fit the 64 MiB the run tool carries; about 2 minutes here)
# the `run` tool: carry [".devspec"], command: bash scripts/device/run_step_trace.sh
# (about 210 s of device time for the GLM-5 slice, 370 s with NQ_SLICE2=dsv3:4:32:32)
set -uo pipefail
source "$(dirname "$0")/devspec_prelude.sh" /tmp/nq-devtrace
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [[ "${NQ_TESTS:-1}" != 0 ]]; then
  filter="${NQ_TEST_FILTER:-CudaMoeRoute*:CudaSideWork*}"
  ops_tests "$filter" "$filter:-*Timing" || status=1
fi
if [[ -x "$B/graph_launch_bench" ]]; then
  "$B/graph_launch_bench" >"$out/graph_launch.txt" 2>&1 || status=1
  cat "$out/graph_launch.txt"
fi

# Rounds of every build in the bundle on the current slice, interleaved: nq ("new"), nq_before
# ("before"), any other nq_NAME ("NAME") and NQ_FLAG_VARIANTS' runs of nq; runs named
# PREFIX_VARIANT_ROUND. One line a run: BIN:VARIANT:FLAGS (flags comma-separated, maybe none).
variants() {
  local bin spec
  echo "nq:new:"
  for bin in "$B"/nq_*; do
    [[ -x "$bin" ]] || continue
    bin=$(basename "$bin")
    [[ $bin == *bench* ]] && continue  # nq_moe_bench and the like share the bundle, not nq builds
    if [[ $bin == nq_before ]]; then echo "nq_before:before:"; else echo "$bin:${bin#nq_}:"; fi
  done
  for spec in ${NQ_FLAG_VARIANTS:-}; do echo "nq:${spec%%=*}:${spec#*=}"; done
}
time_slice() {
  local prefix="$1" round run bin variant flags line
  for round in $(seq 1 "${NQ_ROUNDS:-2}"); do
    for run in $(variants); do
      bin="${run%%:*}" variant="${run#*:}"
      flags="${variant#*:}" variant="${variant%%:*}"
      # shellcheck disable=SC2086  # NQ_SLICE_FLAGS and the variant's flags: several, split
      line=$(bench_slice "$bin" "$out/${prefix}_${variant}_$round.txt" ${NQ_SLICE_FLAGS:-} ${flags//,/ }) || status=1
      echo "== $prefix round $round, $variant: $line"
    done
  done
  compare_tokens "$out/${prefix}"_*.json | tee "$out/${prefix}_tokens.txt" || status=1
}

make_bench_slice "${NQ_SLICE:-glm5:4:256:4000}" /tmp/nq-trace-slice "$out/make_slice.txt" || exit 1
if [[ "${NQ_TRACE:-1}" != 0 ]]; then
  CUDA_INJECTION64_PATH="$B/../lib/libnq_kernel_trace.so" NQ_KERNEL_TRACE=/tmp/nq_trace.csv \
    bench_slice nq "$out/traced.txt" || status=1
  grep -h "nq_kernel_trace" "$out/traced.txt"
fi
if [[ -f /tmp/nq_trace.csv ]]; then
  xz -6 -c /tmp/nq_trace.csv >"$out/trace.csv.xz"
  python3 scripts/device/kernel_trace_table.py /tmp/nq_trace.csv --timeline >"$out/trace_table.txt" 2>&1 || status=1
  sed -n '1,/^== the median replay/p' "$out/trace_table.txt" | head -80
fi
time_slice slice
rm -rf "$SLICE_DIR"
if [[ -n "${NQ_SLICE2:-}" ]]; then
  make_bench_slice "$NQ_SLICE2" /tmp/nq-trace-slice2 "$out/make_slice2.txt" || exit 1
  time_slice slice2
  rm -rf "$SLICE_DIR"
fi
exit "$status"
