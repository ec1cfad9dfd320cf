#!/usr/bin/env bash
# One device call for serving on the GPU (issue #14): unpacks .gpu-cluster/bundle.tar.xz
# (scripts/device/package_cluster.sh: the four binaries of a CUDA build, the shared libraries the
# GPU machine lacks, glm5_nano and its release), says what it carried, checks that the worker
# refuses clearly where it must (an ordinal past the visible GPUs, a model that does not fit),
# then runs scripts/device/gpu_cluster_check.py: router, streamer and a CUDA worker on the H200
# against a CPU worker's greedy tokens, a streamed chat completion with residuals written into
# device slots, tokens/s through the HTTP stream next to `nq bench-decode`, killing the streamer
# and the worker, and a --verify_slots stress run. Results: $OUT/gpu_cluster.json, the services'
# logs in $OUT/logs/, everything printed in $OUT/gpu_cluster_log.txt.
#
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_gpu_cluster.sh"
#   (bash scripts/device/slim_tree.sh on cluster before, off after)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/nq-gpu-cluster-out}"
mkdir -p "$out"
exec > >(tee "$out/gpu_cluster_log.txt") 2>&1
source scripts/device/unpack_cluster_bundle.sh  # sets $work
echo "   binaries: $(ls "$work/bin" | tr '\n' ' ')"
echo "   libraries ($(ls "$work/lib" | wc -l)): $(ls "$work/lib" | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
if ldd "$work/bin/nq-worker" | grep -q "not found"; then
  ldd "$work/bin/nq-worker" | grep "not found"
  exit 1
fi

failed=()
# Refusals, before anything serves: each must exit non-zero, saying why, within seconds.
refuses() {
  local name="$1" expect="$2"
  shift 2
  local log="$out/logs/refusal-$name.log"
  mkdir -p "$out/logs"
  timeout 120 "$@" >"$log" 2>&1
  local code=$?
  if [[ $code -ne 0 && $code -ne 124 ]] && grep -q "$expect" "$log"; then
    echo "== refusal $name: passed ($(grep -m1 "$expect" "$log" | cut -c1-300))"
  else
    echo "== refusal $name: FAILED (exit $code)"; tail -5 "$log"; failed+=("refusal $name")
  fi
}
worker=("$work/bin/nq-worker" --host=127.0.0.1 --grpc_port=18100 --metrics_port=18101 --backend=cuda
        --model="$work/model" --release="$work/model/release")
refuses gpu-ordinal "visible" "${worker[@]}" --gpu=7
# A context window no H200 holds: the fit check names the KV cache's bytes and the free memory.
refuses does-not-fit "does not fit on GPU 0" "${worker[@]}" --max_model_len=2000000000

# Kernel tests packed beside the services (package_cluster.sh NQ_EXTRA_BINS), plain and under
# compute-sanitizer memcheck.
if [[ -x "$work/bin/cuda_vs_cpu_ops_test" ]]; then
  filter="${NQ_GTEST_FILTER:-CudaMoeRoute*:CudaCopyToHostAsync*}"
  echo "== cuda_vs_cpu_ops_test --gtest_filter=$filter"
  "$work/bin/cuda_vs_cpu_ops_test" --gtest_filter="$filter" 2>&1 | tail -15 || failed+=("cuda_vs_cpu_ops_test")
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  if [[ -n "$sanitizer" ]]; then
    echo "== compute-sanitizer memcheck, same filter"
    "$sanitizer" --tool memcheck --error-exitcode 1 "$work/bin/cuda_vs_cpu_ops_test" --gtest_filter="$filter" 2>&1 \
      | tail -4 || failed+=("memcheck")
  fi
fi
# Before and after in one run: a previous build's nq (bin/nq_before) and this one's, interleaved.
# NQ_BEFORE_FLAGS="--step_graphs=false" makes bin/nq_before this build's nq with those flags (the
# same binary with a feature off; no second binary to carry).
if [[ -n "${NQ_BEFORE_FLAGS:-}" ]]; then
  printf '#!/usr/bin/env bash\nexec "%s" "$@" %s\n' "$work/bin/nq" "$NQ_BEFORE_FLAGS" >"$work/bin/nq_before"
  chmod +x "$work/bin/nq_before"
fi
if [[ -x "$work/bin/nq_before" ]]; then
  for round in 1 2 3; do
    for which in nq_before nq; do
      for bits in fixed 2; do
        log="$out/bench_${which}_${bits}_$round.log"
        "$work/bin/$which" bench-decode --model="$work/model" --release="$work/model/release" --expert-bits=$bits \
          --backend=cuda --decode-tokens=256 --warmup=16 --prompt-tokens=128 \
          --out="$out/bench_${which}_${bits}_$round.json" >"$log" 2>&1
        echo "== bench-decode $which --expert-bits=$bits (round $round): $(tail -1 "$log")"
        grep -h "step graphs" "$log" || true
      done
    done
  done
fi
# NQ_CLUSTER_ARGS / NQ_SLICE_ARGS add arguments (e.g. "--only spec") to the two runs.
if [[ "${NQ_CLUSTER:-1}" == 1 ]]; then
  python3 scripts/device/gpu_cluster_check.py --bin "$work/bin" --model "$work/model" --out "$out" \
    --backend cuda --reference-backend cpu ${NQ_CLUSTER_ARGS:-} || failed+=("gpu_cluster_check")
fi
# Where a decode step's time goes (when the machine has Nsight Systems): the CUDA API calls and
# kernels of 128 bench-decode steps, summarised.
nsys_bin="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)"
if [[ -n "$nsys_bin" && "${NQ_NSYS:-1}" == 1 ]]; then
  echo "== nsys: bench-decode --backend cuda --expert-bits fixed, 128 steps"
  "$nsys_bin" profile -t cuda,osrt --stats=true --force-overwrite=true -o /tmp/nq_bench_decode \
    "$work/bin/nq" bench-decode --model="$work/model" --release="$work/model/release" --expert-bits=fixed \
    --backend=cuda --decode-tokens=128 --warmup=8 --prompt-tokens=16 >"$out/nsys_bench_decode.txt" 2>&1 \
    || echo "nsys failed (see nsys_bench_decode.txt)"
  grep -A 25 -E "cuda_api_sum|cuda_gpu_kern_sum" "$out/nsys_bench_decode.txt" | cut -c1-200 | head -70
else
  echo "== nsys: not on this machine, no profile"
fi
# The same services on a GLM-5-shaped slice (make_slice.sh glm5: GLM-5's layer shapes, random
# weights, its release; NQ_SLICE_SHAPE="layers experts mtp", default 2 16 1): records of 9 MiB
# streamed into device slots, a step long enough for the services' per-token cost to show at its
# real share, and MTP's 1 + 3 verification step against a plain one. No CPU reference (a CPU
# forward at these shapes takes seconds a token).
if [[ "${NQ_SLICE:-1}" == 1 ]]; then
  slice=/tmp/nq_glm5_slice
  read -r slice_layers slice_experts slice_mtp <<<"${NQ_SLICE_SHAPE:-2 16 1}"
  echo "== GLM-5-shaped slice: $slice_layers layers + $slice_mtp MTP, $slice_experts experts"
  if NQ="$work/bin/nq" bash scripts/device/make_slice.sh glm5 "$slice" "$slice_layers" "$slice_experts" "$slice_mtp" \
    >"$out/logs/make_slice.log" 2>&1; then
    grep -E "^(synth-model|synth-release):" "$out/logs/make_slice.log"
    spec=""
    [[ "$slice_mtp" -gt 0 ]] && spec=",spec"
    python3 scripts/device/gpu_cluster_check.py --bin "$work/bin" --model "$slice" --out "$out/slice" \
      --backend cuda --only "bench,http,streaming$spec" --decode-tokens 128 --spec-drafts 0,3 ${NQ_SLICE_ARGS:-} \
      || failed+=("slice")
    # Decode at a 4000-token context, 2-bit experts, BF16 matrices: bytes per step and the
    # roofline ratio (issue #13), and the previous build beside it when packed (bin/nq_before).
    for which in nq_before nq; do
      [[ -x "$work/bin/$which" ]] || continue
      log="$out/slice/bench_${which}_ctx4000.log"
      "$work/bin/$which" bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
        --prompt-tokens=4000 --decode-tokens=64 --warmup=4 --weight-dtype=bf16 \
        --out="$out/slice/bench_${which}_ctx4000.json" >"$log" 2>&1
      echo "== slice bench-decode $which --context=4000 --expert-bits=2 --weight-dtype=bf16: $(tail -1 "$log")"
      grep -h "step graphs" "$log" || true
    done
    # BF16 weight matrices on the slice: bench-decode only (no CPU reference at these shapes).
    "$work/bin/nq" bench-decode --model="$slice" --release="$slice/release" --expert-bits=fixed --backend=cuda \
      --decode-tokens=128 --warmup=8 --prompt-tokens=16 --weight-dtype=bf16 --out="$out/slice/bench_decode_bf16.json" \
      2>&1 | tail -1
  else
    tail -5 "$out/logs/make_slice.log"; failed+=("make_slice")
  fi
  rm -rf "$slice"
fi
# The streamer's reads into device slots against the disk's peak (bench/streamer/record_read_bench:
# a raw O_DIRECT sweep of queue depths and block sizes, then the RecordStore copying each record
# through CUDA IPC into a device arena a forked process exports), on a 2 GiB synthetic release.
# NQ_READ_PIECES: the store's --read_piece_kib values to compare in the same run (0: whole records).
if [[ -x "$work/bin/record_read_bench" && "${NQ_READ_BENCH:-1}" == 1 ]]; then
  df -h /tmp | tail -1
  for piece in ${NQ_READ_PIECES:-256 0}; do
    echo "== record_read_bench --arena=cuda_ipc --read_piece_kib=$piece"
    "$work/bin/record_read_bench" --dir=/tmp/nq_rrb --megabytes=2048 --passes=2 --min_megabytes=2048 \
      --arena=cuda_ipc --read_piece_kib="$piece" 2>&1 | tail -40 | tee "$out/record_read_bench_$piece.txt" \
      || failed+=("record_read_bench $piece")
  done
  rm -rf /tmp/nq_rrb
fi
# The run tool returns a limited number of files: the services' logs travel as one archive.
tar -C "$out" -czf "$out/logs.tar.gz" logs $( [[ -d "$out/slice/logs" ]] && echo slice/logs ) && \
  rm -rf "$out/logs" "$out/slice/logs"
rm -rf "$work"
if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all passed"
