#!/usr/bin/env bash
# On the device: the dense BF16 decode GEMV on the tensor cores (matmul_gemv_mma.cuh) against the
# fp32-FMA one, checked, timed alone and in decode steps with MTP drafts:
#   1. cuda_vs_cpu_ops_test: CudaMatMul* (and CudaTiming.PrintsThroughput*), then CudaMatMul*
#      under compute-sanitizer memcheck and racecheck;
#   2. gemv_bench --quick (both kernels side by side at every projection shape, m = 1, 2, 4, 8)
#      and .hbm/hbm_probe.py when carried;
#   3. a DeepSeek-V3-shaped slice with an MTP layer (make_slice.sh dsv3, built here), then nq
#      bench-decode for each binary of NQ_BINS ("nq nq_before": this build, the build before the
#      tensor-core GEMV) and each run of NQ_RUNS (drafts:device_sampling:temperature[:weight
#      dtype, bf16 or fp8[:decode GEMV, auto, tensor or fma]]).
# Results in $OUT (tests.txt, sanitize.txt, gemv.txt, hbm.txt, slice.txt, bench_*.json / .txt),
# a summary on stdout.
#
# Here (binaries and their libraries, xz-compressed; .devspec/ and .device3/ in .git/info/exclude):
#   cmake --build build/cuda --target nq cuda_vs_cpu_ops_test gemv_bench && mkdir -p .device3/bin .devspec
#   for b in services/tools/nq tests/kernels/cuda_vs_cpu_ops_test tests/kernels/gemv_bench; do
#     strip -o .device3/bin/$(basename $b) build/cuda/$b; done
#   cp NQ_BEFORE .device3/bin/nq_before     # a stripped nq of the build before, when comparing
#   source scripts/device/shared_libs.sh && copy_shared_libs .device3/lib .device3/bin/*
#   tar -C .device3 -cf - bin lib | xz -T0 -9 > .devspec/bundle.tar.xz
#   mkdir -p .hbm && cp ../shared/tools/hbm_probe.py .hbm/ && bash scripts/device/slim_tree.sh on cluster
# the `run` tool: carry [".devspec", ".hbm"], command: bash scripts/device/run_dense_gemv.sh
# NQ_STAGES (default "tests gemv slice"), NQ_LAYERS (2), NQ_DECODE_TOKENS (96).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/out}"
mkdir -p "$out"
source scripts/device/devspec_bundle.sh
unpack_devspec_bundle /tmp/nq-devgemv || exit 1
stages="${NQ_STAGES:-tests gemv slice}"
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [[ " $stages " == *" tests "* ]]; then
  "$B/cuda_vs_cpu_ops_test" --gtest_filter='CudaMatMul*:CudaTiming.PrintsThroughput*' >"$out/tests.txt" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED)|FAILED|worst|timing" "$out/tests.txt" | tail -30
  if command -v compute-sanitizer >/dev/null; then
    {
      compute-sanitizer --tool memcheck "$B/cuda_vs_cpu_ops_test" \
        --gtest_filter='CudaMatMul.MatchesCpu*:CudaMatMul.Bf16*:CudaMatMulBlockScaled.MatchesCpu*:CudaMatMulBlockScaled.Gemv*'
      compute-sanitizer --tool racecheck "$B/cuda_vs_cpu_ops_test" --gtest_filter='CudaMatMul*.GemvRows*'
    } >"$out/sanitize.txt" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitize.txt"
  fi
fi

if [[ " $stages " == *" gemv "* ]]; then
  timeout 200 "$B/gemv_bench" --quick >"$out/gemv.txt" 2>&1 || status=1
  cat "$out/gemv.txt"
  if [[ -f .hbm/hbm_probe.py ]]; then timeout 120 python3 .hbm/hbm_probe.py >"$out/hbm.txt" 2>&1; tail -12 "$out/hbm.txt"; fi
fi

if [[ " $stages " == *" slice "* ]]; then
  slice=/tmp/nq-dsv3-mtp-slice
  start=$(date +%s)
  rm -rf "$slice"  # a warm machine may still hold one of another layer count
  if ! NQ="$B/nq" bash scripts/device/make_slice.sh dsv3 "$slice" "${NQ_LAYERS:-2}" 32 1 >"$out/slice.txt" 2>&1; then
    tail -5 "$out/slice.txt"
    exit 1
  fi
  echo "slice built in $(($(date +%s) - start)) s"
  for run in ${NQ_RUNS:-3:true:0 0:true:0 3:true:0.8 3:false:0.8 0:true:0.8}; do
    IFS=: read -r drafts device temperature dtype gemv <<<"$run"
    dtype="${dtype:-bf16}" gemv="${gemv:-auto}"
    for bin in ${NQ_BINS:-nq nq_before}; do
      [[ -x "$B/$bin" ]] || continue
      name="${bin}_${drafts}_${device}_${temperature}_${dtype}"
      [[ "$gemv" == auto ]] || name="${name}_${gemv}"
      gemv_flag=()
      [[ "$gemv" == auto ]] || gemv_flag=(--decode_gemv="$gemv")  # builds before the flag take auto only
      timeout 150 "$B/$bin" bench-decode --model "$slice" --release "$slice/release" --expert-bits 2 --backend cuda \
        --weight_dtype "$dtype" --prompt-tokens 32 --warmup 8 --decode-tokens "${NQ_DECODE_TOKENS:-96}" --seed 7 \
        --sampling_temperature "$temperature" --speculative_tokens "$drafts" --device_sampling="$device" \
        "${gemv_flag[@]}" --out "$out/bench_$name.json" >"$out/bench_$name.txt" 2>&1 || status=1
      echo "== $bin: drafts $drafts, device sampling $device, temperature $temperature, $dtype, GEMV $gemv:"
      grep -E "tokens/s" "$out/bench_$name.txt" | tail -1
    done
  done
  # Batch invariance end to end: greedy tokens with drafts equal those without, per binary.
  for bin in ${NQ_BINS:-nq nq_before}; do for dtype in bf16 fp8; do
    a="$out/bench_${bin}_3_true_0_${dtype}.json" b="$out/bench_${bin}_0_true_0_${dtype}.json"
    [[ -f "$a" && -f "$b" ]] || continue
    python3 - "$a" "$b" "$bin $dtype" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = a.get("tokens", []), b.get("tokens", [])
n = min(len(ta), len(tb))
# Both end at the same position (prompt + warm-up + timed tokens); with drafts the timed tokens are
# that sequence's last ones, so compare the suffixes.
same = n > 0 and ta[len(ta) - n:] == tb[len(tb) - n:]
print(f"{sys.argv[3]}: greedy tokens with 3 drafts {'equal' if same else 'DIFFER from'} those without ({n} compared)")
sys.exit(0 if same else 1)
PY
  done; done
fi
exit "$status"
