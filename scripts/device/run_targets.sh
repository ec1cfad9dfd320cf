#!/usr/bin/env bash
# Every GPU target of issues #12, #13 and #20 in one device call (for an H200, whose targets they
# are: machines of that kind come seldom, so one call should bring back every figure):
#   1. shared/tools/hbm_probe.py (the yardsticks), when carried in .hbm/;
#   2. nq_moe_bench --quick --codec=scalar (#12: the MoE block at 1 and 4 tokens, 2 / 4 bits);
#   3. nvfp4_moe_bench --quick (#20: the NVFP4 expert GEMV over copy bandwidth);
#   4. mla_decode_bench and indexer_bench (#13: MLA decode and the indexer's selection);
#   5. the GLM-5 slice (glm5:4:256:4000) and the DeepSeek-V3 slice (dsv3:4:32:32) through nq
#      bench-decode (#13's roofline ratio and tokens/s), NQ_ROUNDS (1) rounds each,
# each step skipped once fewer than its estimated seconds of NQ_BUDGET (540) remain, so what ran
# comes back (the per-call limit is 600 s). Results in $OUT/targets.tar.xz (one file: the run tool
# brings back few) and on stdout.
#
# Here: build the CUDA preset's nq and the four benches, then
#   mkdir -p .device3/bin .devspec .hbm && cp ../shared/tools/hbm_probe.py .hbm/
#   for b in nq_moe_bench nvfp4_moe_bench mla_decode_bench indexer_bench; do
#     strip -o .device3/bin/$b build/cuda/tests/kernels/$b; done
#   strip -o .device3/bin/nq build/cuda/services/tools/nq
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/*
#   tar -C .device3 -cf - bin lib | xz -T1 -9 > .devspec/bundle.tar.xz && bash scripts/device/slim_tree.sh on cluster
# the `run` tool: carry [".devspec", ".hbm"], command: bash scripts/device/run_targets.sh
# (then bash scripts/device/slim_tree.sh off)
set -uo pipefail
source "$(dirname "$0")/devspec_prelude.sh" /tmp/nq-targets
status=0
t0=$SECONDS
left() { echo $(("${NQ_BUDGET:-540}" - (SECONDS - t0))); }
# step SECONDS NAME COMMAND...: runs it into $out/NAME.txt unless fewer than SECONDS remain.
step() {
  local need="$1" name="$2"
  shift 2
  if (("$(left)" < need)); then
    echo "== $name: skipped ($(left) s left, about $need needed)"
    return 0
  fi
  local start=$SECONDS
  if "$@" >"$out/$name.txt" 2>&1; then echo "== $name ($((SECONDS - start)) s)"; else
    echo "== $name: FAILED ($((SECONDS - start)) s)"
    status=1
  fi
  tail -n "${NQ_TAIL:-14}" "$out/$name.txt"
}
slices() {
  local spec="$1" name="$2" round line
  make_bench_slice "$spec" "/tmp/nq-targets-$name" "$out/make_$name.txt" || return 1
  for round in $(seq 1 "${NQ_ROUNDS:-1}"); do
    line=$(bench_slice nq "$out/${name}_$round.txt") || return 1
    echo "$name round $round: $line"
  done
  rm -rf "$SLICE_DIR"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
[[ -f .hbm/hbm_probe.py ]] && step 60 hbm_probe python3 .hbm/hbm_probe.py
step 60 nq_moe "$B/nq_moe_bench" --quick --codec=scalar
step 60 nvfp4_moe "$B/nvfp4_moe_bench" --quick
step 160 mla_decode "$B/mla_decode_bench"
step 60 indexer "$B/indexer_bench"
step 120 slice_glm5 slices glm5:4:256:4000 glm5
step 100 slice_dsv3 slices dsv3:4:32:32 dsv3
# Only the archive stays in $OUT: the run tool brings back a few files, and the first call left
# the archive out behind the per-step files.
tar -C "$out" -cJf /tmp/nq-targets.tar.xz . && find "$out" -mindepth 1 -delete &&
  mv /tmp/nq-targets.tar.xz "$out/targets.tar.xz"
exit "$status"
