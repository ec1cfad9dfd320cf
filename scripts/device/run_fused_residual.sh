#!/usr/bin/env bash
# On the device: residual connections added in the next norm (Backend::AddRmsNorm,
# --fused_residual_norm; bench/README.md, "Residual connections added in the next norm"):
#   1. cuda_vs_cpu_ops_test CudaAddRmsNorm*, CudaRmsNorm* and CudaRope* (the fused kernel bit for
#      bit against the Add and RmsNorm kernels, and against the CPU; several tensors rotated in one
#      RoPE launch against a launch each), then compute-sanitizer memcheck of them;
#   2. cuda_model_test *Residuals* (the fixtures' logits with the option on, CUDA against the CPU);
#   3. the GLM-5 slice (NQ_SLICE, default glm5:4:256:4000: make_slice.sh's arch, layers, experts,
#      then the context; BF16 matrices, 2-bit experts) decoded with --fused_residual_norm (the
#      default since the thirty-eighth session) and with --fused_residual_norm=false, and by the bundle's nq_before if it has one (an nq of an earlier
#      commit, to time what changed since), NQ_ROUNDS (2) rounds interleaved: tokens/s, and the
#      same greedy tokens in every run (the script fails otherwise).
# Results in $OUT (tests.txt, memcheck.txt, model.txt, slice_*.txt / .json), a summary on stdout.
#
# Here (binaries and their libraries, xz-compressed; .devspec/ and .device3/ in .git/info/exclude):
#   cmake --build build/cuda --target cuda_vs_cpu_ops_test cuda_model_test nq && mkdir -p .device3/bin .devspec
#   for b in tests/kernels/cuda_vs_cpu_ops_test tests/model_graph/cuda_model_test services/tools/nq; do
#     strip -o .device3/bin/$(basename $b) build/cuda/$b; done
#   (optional: strip -o .device3/bin/nq_before an nq built at an earlier commit)
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/*
#   tar -C .device3 -cf - bin lib | xz -T0 -9 > .devspec/bundle.tar.xz && bash scripts/device/slim_tree.sh on
# (cuda_model_test reads tests/fixtures/models: plain `on`, not `on cluster`, keeps them)
# the `run` tool: carry [".devspec"], command: bash scripts/device/run_fused_residual.sh
set -uo pipefail
source "$(dirname "$0")/devspec_prelude.sh" /tmp/nq-devfused
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

ops_tests 'CudaAddRmsNorm*:CudaRmsNorm*:CudaRope*' || status=1
"$B/cuda_model_test" --gtest_filter='*Residuals*' >"$out/model.txt" 2>&1 || status=1
grep -E "cuda model|^\[  (PASSED|FAILED)|FAILED" "$out/model.txt" | tail -8

make_bench_slice "${NQ_SLICE:-glm5:4:256:4000}" /tmp/nq-fused-slice "$out/make_slice.txt" || exit 1
for round in $(seq 1 "${NQ_ROUNDS:-2}"); do
  variants=(separate fused)
  [[ -x "$B/nq_before" ]] && variants+=(before)
  for variant in "${variants[@]}"; do
    flags=()
    [[ $variant == separate ]] && flags=(--fused_residual_norm=false)
    bin=nq
    [[ $variant == before ]] && bin=nq_before
    line=$(bench_slice "$bin" "$out/slice_${variant}_$round.txt" "${flags[@]}") || status=1
    echo "== round $round, $variant: $line"
  done
done
# Every run must decode the same greedy tokens.
compare_tokens "$out"/slice_*.json | tee "$out/slice_tokens.txt" || status=1
rm -rf "$SLICE_DIR"
exit "$status"
