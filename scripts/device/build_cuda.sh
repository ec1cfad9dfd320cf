#!/usr/bin/env bash
# Builds the kernel backends and their tests with CUDA on this machine (nvcc, no GPU needed):
# nq_backend, cpu_ops_test and cuda_vs_cpu_ops_test. Then run package.sh.
#
#   bash scripts/device/build_cuda.sh                 # the in-tree `cuda` preset (build/cuda)
#   bash scripts/device/build_cuda.sh --kernels-only  # kernels/ + tests/kernels/ alone
#                                                     # (build/cuda-kernels), for when the rest of
#                                                     # the tree does not configure
# Prints the build directory as its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."

readonly NVCC=/usr/local/cuda/bin/nvcc
if [[ ! -x "$NVCC" ]] && ! command -v nvcc >/dev/null; then
  echo "build_cuda.sh: nvcc not found (expected $NVCC)" >&2
  exit 1
fi

targets=(nq_backend cpu_ops_test cuda_vs_cpu_ops_test cuda_model_test cuda_ipc_arena_test nq_moe_bench mla_decode_bench
  nvfp4_moe_bench)
case "${1:-}" in
  "")
    build_dir=build/cuda
    cmake --preset cuda
    ;;
  --kernels-only)
    build_dir=build/cuda-kernels
    targets=(nq_backend cpu_ops_test cuda_vs_cpu_ops_test nq_moe_bench mla_decode_bench nvfp4_moe_bench)
    cmake -S scripts/device/kernels_only -B "$build_dir" -G Ninja \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_COMPILER="$NVCC" \
      -DCMAKE_CUDA_ARCHITECTURES=90a
    ;;
  *)
    echo "usage: $0 [--kernels-only]" >&2
    exit 2
    ;;
esac
cmake --build "$build_dir" -j "$(nproc)" --target "${targets[@]}"
echo "$build_dir"
