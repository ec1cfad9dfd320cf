#!/usr/bin/env bash
# Runs the kernel tests on the GPU machine, from the repository root, out of .device/ (carried
# there by the `run` tool; see scripts/device/README.md). Prints the GPU, runs cpu_ops_test and
# cuda_vs_cpu_ops_test, and exits non-zero if any of them fails.
#
#   bash scripts/device/run_on_device.sh [gtest flags for cuda_vs_cpu_ops_test...]
#   NQ_DEVICE_SANITIZE=1 ...   also runs the correctness tests under compute-sanitizer
#                              (memcheck, and racecheck on the small shared-memory cases)
#   NQ_TEST_SEED=N ...         replays a run's random inputs
# Everything printed is also written to $OUT/device_log.txt when $OUT is set (the run tool).
set -uo pipefail
cd "$(dirname "$0")/../.."

readonly dev="$PWD/.device"
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
  exec > >(tee "$OUT/device_log.txt") 2>&1
fi

if [[ ! -x "$dev/bin/cuda_vs_cpu_ops_test" ]]; then
  echo "run_on_device.sh: $dev/bin/cuda_vs_cpu_ops_test missing: run build_cuda.sh and package.sh" \
    "on the build machine and carry .device" >&2
  exit 2
fi
[[ -f "$dev/MANIFEST" ]] && head -n 1 "$dev/MANIFEST"

export LD_LIBRARY_PATH="$dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS (and NCCL) from the machine's CUDA wheels: the binaries link them dynamically.
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
if ldd "$dev/bin/cuda_vs_cpu_ops_test" 2>&1 | grep -q "not found"; then
  echo "run_on_device.sh: this machine's C++ runtime is older than the build machine's;" \
    "using .device/compat"
  ldd "$dev/bin/cuda_vs_cpu_ops_test" 2>&1 | grep "not found"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dev/compat"
fi

echo "== nvidia-smi"
nvidia-smi || echo "(nvidia-smi failed)"

failed=()
run() {
  local name="$1"
  shift
  echo "== $name"
  local start=$SECONDS
  if "$@"; then
    echo "== $name: passed ($((SECONDS - start)) s)"
  else
    echo "== $name: FAILED ($((SECONDS - start)) s)"
    failed+=("$name")
  fi
}

run cpu_ops_test "$dev/bin/cpu_ops_test" --gtest_brief=1
run cuda_vs_cpu_ops_test "$dev/bin/cuda_vs_cpu_ops_test" --gtest_color=no "$@"
# The GLM-5 / DeepSeek-V3 graph on the CUDA backend against HF's reference logits (the
# fixtures travel with the working tree; run from the repository root).
run cuda_model_test "$dev/bin/cuda_model_test" --gtest_color=no
# Slot arenas across processes: a forked "streamer" writes into a "worker's" CUDA IPC arena.
if [[ -x "$dev/bin/cuda_ipc_arena_test" ]]; then
  run cuda_ipc_arena_test "$dev/bin/cuda_ipc_arena_test" --gtest_color=no
fi

if [[ "${NQ_DEVICE_SANITIZE:-0}" == 1 ]]; then
  if command -v compute-sanitizer >/dev/null; then
    run "memcheck (correctness tests)" compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$dev/bin/cuda_vs_cpu_ops_test" --gtest_brief=1 --gtest_filter=-CudaTiming.*
    run "racecheck (small shared-memory cases)" compute-sanitizer --tool racecheck \
      --error-exitcode 1 "$dev/bin/cuda_vs_cpu_ops_test" --gtest_brief=1 \
      --gtest_filter='CudaMatMul.FoldsLeading*:CudaRmsNorm.RunsInPlace:CudaSoftmax.Masked*:CudaMlaAttention.Tiny*:CudaIndexerTopK.Tiny*'
  else
    echo "compute-sanitizer not found; sanitizer runs skipped"
  fi
fi

if ((${#failed[@]})); then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all passed"
