#!/usr/bin/env bash
# Fills .device/ (git-ignored) with what the GPU machine needs to run the kernel tests:
#   .device/bin/     cuda_vs_cpu_ops_test, cpu_ops_test, cuda_model_test (debug info stripped)
#   .device/lib/     every shared library they load (ldd) except the C/C++ runtime and the CUDA
#                    driver, which the GPU machine has (today: Abseil; cudart and GTest are static)
#   .device/compat/  this machine's libstdc++ / libgcc_s, used by run_on_device.sh only if the
#                    GPU machine's are too old for the binaries
#   .device/MANIFEST what was packed, from which commit, with sha256 sums
# Then call the `run` tool with carry [".device"] (scripts/device/README.md).
#
#   bash scripts/device/package.sh [BUILD_DIR]   # default build/cuda
set -euo pipefail
cd "$(dirname "$0")/../.."

build_dir="${1:-build/cuda}"
readonly out=.device
readonly required=(tests/kernels/cuda_vs_cpu_ops_test tests/kernels/cpu_ops_test)
# Packed when built (a kernels-only build has no model test).
readonly optional=(tests/model_graph/cuda_model_test tests/kernels/cuda_ipc_arena_test tests/kernels/nq_moe_bench tests/kernels/mla_decode_bench
  tests/kernels/nvfp4_moe_bench)

for b in "${required[@]}"; do
  if [[ ! -x "$build_dir/$b" ]]; then
    echo "package.sh: $build_dir/$b missing; run scripts/device/build_cuda.sh first" >&2
    exit 1
  fi
done
binaries=("${required[@]}")
for b in "${optional[@]}"; do
  if [[ -x "$build_dir/$b" ]]; then binaries+=("$b"); else echo "package.sh: $b not built, not packed"; fi
done

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/compat"
for b in "${binaries[@]}"; do
  cp "$build_dir/$b" "$out/bin/"
  strip --strip-debug "$out/bin/$(basename "$b")"
done

source scripts/device/shared_libs.sh
copy_shared_libs "$out/lib" "$out"/bin/*

for name in libstdc++.so.6 libgcc_s.so.1; do
  path="$(ldd "$out/bin/cuda_vs_cpu_ops_test" | awk -v n="$name" '$1 == n { print $3 }')"
  [[ -n "$path" ]] && cp -L "$path" "$out/compat/$name"
done

{
  commit="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) from $commit (+ working tree changes)" \
    "by scripts/device/package.sh, build dir $build_dir"
  (cd "$out" && find bin lib compat -type f -print0 | sort -z | xargs -0 sha256sum)
} > "$out/MANIFEST"

echo "package.sh: $(find "$out/lib" -type f | wc -l) libraries, $(du -sh "$out" | cut -f1) in $out/"
