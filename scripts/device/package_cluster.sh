#!/usr/bin/env bash
# Packs what the GPU machine needs to run the whole cluster (scripts/device/run_gpu_cluster.sh)
# into .gpu-cluster/bundle.tar.xz (git-ignored), one file small enough for the `run` tool's
# 64 MiB (the tree, slimmed by slim_tree.sh, plus what it carries):
#   bin/    nq-router, nq-worker, nq-streamer, nq and record_read_bench from a CUDA build (debug
#           info stripped)
#   lib/    their non-system shared libraries (gRPC, protobuf, Abseil, OpenSSL, ...), which the
#           GPU machine (Ubuntu 24.04, no gRPC) lacks; scripts/device/shared_libs.sh says which stay
#   model/  models/glm5_nano (its weights leave the slimmed tree) and its NestQuant release,
#           made here by scripts/embedded_model.sh
#   MANIFEST  commit, date, sha256 of every file
# Then: bash scripts/device/slim_tree.sh on; run with carry [".gpu-cluster"] and
# command "bash scripts/device/run_gpu_cluster.sh"; bash scripts/device/slim_tree.sh off.
#
#   bash scripts/device/package_cluster.sh [CUDA_BUILD_DIR]   # default build/cuda
#
# NQ_EXTRA_BINS="NAME=PATH ..." packs more binaries as bin/NAME: a previous build's nq as
# nq_before (run_gpu_cluster.sh then times both in one run), cuda_vs_cpu_ops_test (it runs the
# kernel tests named by NQ_GTEST_FILTER there). NQ_NO_READ_BENCH=1 leaves record_read_bench out
# (scripts that do not read records, when the extra binaries need its room).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/shared_libs.sh

build_dir="${1:-build/cuda}"
readonly out=.gpu-cluster
readonly binaries=(services/router/nq-router services/worker/nq-worker services/streamer/nq-streamer services/tools/nq)
readonly model_files=(config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json)

cmake --build "$build_dir" --target nq-router nq-worker nq-streamer nq record_read_bench >/dev/null
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin" "$staging/model"
extras=(bench/streamer/record_read_bench)
[[ "${NQ_NO_READ_BENCH:-0}" == 1 ]] && extras=()
for b in "${binaries[@]}" "${extras[@]}"; do
  strip --strip-debug -o "$staging/bin/$(basename "$b")" "$build_dir/$b"
done
for extra in ${NQ_EXTRA_BINS:-}; do
  strip --strip-debug -o "$staging/bin/${extra%%=*}" "${extra#*=}"
done
copy_shared_libs "$staging/lib" "$staging"/bin/*

# The release is encoded by the CPU build's nq (deterministic; the same one the tests use).
NQ_BIN="${NQ_BIN:-build/cpu/services/tools/nq}" bash scripts/embedded_model.sh build/cpu/embedded-model >/dev/null
for f in "${model_files[@]}"; do cp "models/glm5_nano/$f" "$staging/model/"; done
cp -r build/cpu/embedded-model/release "$staging/model/release"

{
  echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD) (+ working tree changes)" \
    "by scripts/device/package_cluster.sh, build dir $build_dir"
  (cd "$staging" && find bin lib model -type f -print0 | sort -z | xargs -0 sha256sum)
} >"$staging/MANIFEST"

rm -rf "$out"
mkdir -p "$out"
tar -C "$staging" -cf - bin lib model MANIFEST | xz -T0 -9e >"$out/bundle.tar.xz"  # -9e: the binaries share most bytes (45 vs 60 MB)
echo "package_cluster.sh: $(ls "$staging/lib" | wc -l) libraries, bundle $(du -h "$out/bundle.tar.xz" | cut -f1)"
