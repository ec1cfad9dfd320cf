#!/usr/bin/env bash
# Where a decode step's time goes on the H200 (issue #13): every kernel of the last decode steps
# of `nq bench-decode` under ncu (duration and DRAM bytes per kernel, clocks left alone), grouped
# by kernel, on the GLM-5-shaped slice at a 4000-token context (2-bit experts, BF16 matrices; make_slice.sh) and
# on glm5_nano. Also the slice's tokens/s with step graphs in the same call, hbm_probe's
# yardsticks, and the cluster's greedy check with the reference's top-2 margin at a divergence.
# Over the .gpu-cluster bundle (scripts/device/package_cluster.sh); .hbm/hbm_probe.py carried.
#
#   run tool: carry [".gpu-cluster", ".hbm"], command "bash scripts/device/profile_decode_step.sh"
# With bin/cuda_vs_cpu_ops_test in the bundle (NQ_EXTRA_BINS), the decode-step kernels' tests
# run first (NQ_OPS_FILTER), and under compute-sanitizer memcheck (NQ_OPS_MEMCHECK=0: not; racecheck
# over NQ_OPS_RACECHECK's filter; NQ_MEMCHECK_FILTER narrows memcheck's); with bin/nq_before (a previous
# build), the slice's tokens/s are measured for both, interleaved.
# With bin/gemv_bench, the dense GEMV at GLM-5 / DeepSeek-V3 shapes (NQ_GEMV_ARGS, default
# --quick: the automatic split counts only).
# With bin/mla_decode_bench, the MLA decode kernels per cache dtype (NQ_MLA_ONLY: its --only).
# NQ_PROFILE_ONLY=ops|indexer|sampler|hbm|gemv|mla|slice|sampling|kvfp8|nano|greedy (comma list) limits what runs;
# NQ_SLICE_DTYPES (default bf16) the --weight-dtype values the slice's tokens/s are measured at (e.g.
# "bf16 fp8"); NQ_SLICE_VARIANTS extra bench-decode flags per timing, one variant per word, flags
# joined by commas (e.g. "--device_sampling=true --device_sampling=false");
# NQ_SLICES the slices (below), e.g. "glm5:4:256:4000 dsv3:4:32:32" for issue #13's two targets;
# NQ_SLICE_NSYS=1 adds the first slice's step as it runs in its graph (nsys, graph_step_table.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-profile-out}"
mkdir -p "$OUT"
only="${NQ_PROFILE_ONLY:-ops,indexer,sampler,hbm,gemv,mla,slice,sampling,kvfp8,nano,greedy}"
wants() { [[ ",$only," == *",$1,"* ]]; }
w=$(mktemp -d)
tar -C "$w" -xJf .gpu-cluster/bundle.tar.xz || { echo "cannot unpack .gpu-cluster/bundle.tar.xz"; exit 1; }
export LD_LIBRARY_PATH="$w/lib:$(bash scripts/device/cuda_wheel_libs.sh)"
B=$w/bin

if wants ops && [[ -x $B/cuda_vs_cpu_ops_test ]]; then
  filter="${NQ_OPS_FILTER:-CudaMatMul*:CudaRmsNorm*:CudaIndexer*:CudaStepPosition*:CudaMla*}"
  $B/cuda_vs_cpu_ops_test --gtest_filter="$filter" > "$OUT/ops.txt" 2>&1; echo "== ops ($filter) rc $?"
  grep -E "^\[  (PASSED|FAILED)|FAILED|worst" "$OUT/ops.txt" | head -40
  if [[ "${NQ_OPS_MEMCHECK:-1}" == 1 ]]; then
    memcheck_filter="${NQ_MEMCHECK_FILTER:-$filter}"  # a smaller set when the whole filter is slow under memcheck
    compute-sanitizer --tool memcheck $B/cuda_vs_cpu_ops_test --gtest_filter="$memcheck_filter" > /tmp/memcheck.txt 2>&1
    echo "== memcheck ($memcheck_filter) rc $?"; tail -2 /tmp/memcheck.txt; grep -m5 -A8 "Invalid\|ERROR SUMMARY: [1-9]" /tmp/memcheck.txt
  fi
  if [[ -n "${NQ_OPS_RACECHECK:-}" ]]; then  # a filter of cases small enough for racecheck
    compute-sanitizer --tool racecheck $B/cuda_vs_cpu_ops_test --gtest_filter="$NQ_OPS_RACECHECK" > /tmp/racecheck.txt 2>&1
    echo "== racecheck ($NQ_OPS_RACECHECK) rc $?"; tail -2 /tmp/racecheck.txt; grep -m5 -A8 "hazard\|ERROR SUMMARY: [1-9]" /tmp/racecheck.txt
  fi
fi

if wants gemv && [[ -x $B/gemv_bench ]]; then
  $B/gemv_bench ${NQ_GEMV_ARGS:---quick} > "$OUT/gemv.txt" 2>&1; echo "== gemv_bench rc $?"; cat "$OUT/gemv.txt"
fi

if wants mla && [[ -x $B/mla_decode_bench ]]; then
  $B/mla_decode_bench ${NQ_MLA_ONLY:+--only "$NQ_MLA_ONLY"} > "$OUT/mla.txt" 2>&1; echo "== mla_decode_bench rc $?"; cat "$OUT/mla.txt"
fi

# With bin/indexer_bench: the DSA indexer's decode selection per case; NQ_INDEXER_NCU="CASE ..."
# (indexer_bench --only values) adds ncu --set full on each such case's kernels.
if wants indexer && [[ -x $B/indexer_bench ]]; then
  $B/indexer_bench > "$OUT/indexer.txt" 2>&1; echo "== indexer_bench rc $?"; cat "$OUT/indexer.txt"
  for case in ${NQ_INDEXER_NCU:-}; do
    ncu --set full -k regex:Indexer --launch-count 3 "$B/indexer_bench" --quick --only "${case//_/ }" \
      > "/tmp/ncu_indexer_$case.txt" 2>&1
    echo "== ncu indexer $case rc $?"
    grep -E "^  [A-Za-z].*Kernel|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Block Size|Grid Size|Theoretical Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|One or More Eligible" \
      "/tmp/ncu_indexer_$case.txt" | head -90
  done
  cat /tmp/ncu_indexer_*.txt 2>/dev/null | xz -9 > "$OUT/ncu_indexer.txt.xz"
fi

# With bin/sampler_bench: the host's next-token pick at GLM-5's and DeepSeek-V3's vocabularies, on
# this machine's CPU (the one a worker serves from).
if wants sampler && [[ -x $B/sampler_bench ]]; then
  $B/sampler_bench > "$OUT/sampler.txt" 2>&1; echo "== sampler_bench rc $?"; grep -E "^BM_|CPU|Run on" "$OUT/sampler.txt"
fi

if wants hbm && [[ -f .hbm/hbm_probe.py ]]; then
  python3 .hbm/hbm_probe.py > "$OUT/hbm.txt" 2>&1; echo "== hbm_probe rc $?"; tail -12 "$OUT/hbm.txt"
fi

# ncu over a bench-decode run; the per-kernel table of its last two decode steps.
profile() {  # name, bench-decode flags...
  local name="$1"; shift
  ncu --clock-control none --csv --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$B/nq" bench-decode --backend=cuda --step_graphs=false --copy_mb=0 "$@" > "/tmp/ncu_$name.csv" 2> "/tmp/ncu_$name.err"
  echo "== ncu $name rc $? ($(wc -l < "/tmp/ncu_$name.csv") csv lines)"
  xz -6 -c "/tmp/ncu_$name.csv" > "$OUT/ncu_$name.csv.xz"  # the raw kernels, for what the table leaves out
  python3 scripts/device/ncu_step_table.py "/tmp/ncu_$name.csv" > "$OUT/profile_$name.txt" 2>&1 ||
    { echo "-- no step table; the end of ncu's stderr:"; tail -8 "/tmp/ncu_$name.err"; grep -v '^"' "/tmp/ncu_$name.csv" | tail -5; } >> "$OUT/profile_$name.txt"
  cat "$OUT/profile_$name.txt"
}

# Each slice of NQ_SLICES ("arch:layers:experts:context", default the GLM-5 slice of the earlier
# runs): made by make_slice.sh (synthetic release), timed at every NQ_SLICE_DTYPES, removed; the
# first is also profiled under ncu (NQ_SLICE_NCU=0 skips that); NQ_SLICE_ROUNDS rounds (default 2).
if wants slice; then
  first=1
  for spec in ${NQ_SLICES:-glm5:3:8:4000}; do
    IFS=: read -r arch layers experts context <<<"$spec"
    slice=/tmp/nq_slice_$arch
    rm -rf "$slice"
    if ! NQ="$B/nq" bash scripts/device/make_slice.sh "$arch" "$slice" "$layers" "$experts" 0 > /tmp/make_slice.log 2>&1; then
      echo "make_slice $spec failed"; tail -5 /tmp/make_slice.log; rm -rf "$slice"; continue
    fi
    echo "== slice $spec: $(grep -E "^(synth-model|synth-release):" /tmp/make_slice.log | tr '\n' ' ')"
    for round in $(seq 1 "${NQ_SLICE_ROUNDS:-2}"); do
      for which in nq_before nq; do
        [[ -x "$B/$which" ]] || continue
        for dtype in ${NQ_SLICE_DTYPES:-bf16}; do
          for variant in ${NQ_SLICE_VARIANTS:-default}; do
            flags=()
            [[ $variant != default ]] && IFS=, read -ra flags <<<"$variant"
            log="/tmp/slice_${arch}_${which}_${dtype}.log"
            "$B/$which" bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
              --prompt-tokens="$context" --decode-tokens=64 --warmup=4 --weight-dtype=$dtype "${flags[@]}" > "$log" 2>&1
            echo "== round $round $which slice $spec 2-bit $dtype $variant: $(tail -1 "$log" | sed 's/.*H200[^:]*: //')"
          done
        done
      done
    done
    # NQ_SLICE_NSYS=1: the step as it runs in its graph (nsys traces each graph node), for the
    # first slice: wall time, busy time and the idle time between kernels (graph_step_table.py).
    nsys_bin="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)"
    if [[ $first == 1 && "${NQ_SLICE_NSYS:-0}" == 1 && -z "$nsys_bin" ]]; then
      echo "== nsys: not on this machine, no graph trace"
    fi
    if [[ $first == 1 && "${NQ_SLICE_NSYS:-0}" == 1 && -n "$nsys_bin" ]]; then
      "$nsys_bin" profile -t cuda --cuda-graph-trace=node --force-overwrite=true -o /tmp/slice_graph \
        "$B/nq" bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
        --prompt-tokens="$context" --decode-tokens=8 --warmup=2 --copy_mb=0 > /tmp/slice_nsys.log 2>&1
      echo "== nsys slice rc $?"
      "$nsys_bin" stats --report cuda_gpu_trace --format csv --force-export=true -o /tmp/slice_graph \
        /tmp/slice_graph.nsys-rep > /tmp/slice_nsys_stats.log 2>&1
      trace=$(ls /tmp/slice_graph*cuda_gpu_trace*.csv 2>/dev/null | head -n 1)
      if [[ -n "$trace" ]]; then
        xz -6 -c "$trace" > "$OUT/slice_graph_trace.csv.xz"
        python3 scripts/device/graph_step_table.py "$trace" > "$OUT/graph_step.txt" 2>&1; cat "$OUT/graph_step.txt"
      else
        echo "no nsys trace:"; tail -5 /tmp/slice_nsys.log /tmp/slice_nsys_stats.log
      fi
    fi
    if [[ $first == 1 && "${NQ_SLICE_NCU:-1}" == 1 ]]; then
      profile slice --model="$slice" --release="$slice/release" --expert-bits=2 --weight-dtype=bf16 \
        --prompt-tokens="$context" --decode-tokens=2 --warmup=1
    fi
    first=0
    rm -rf "$slice"
  done
fi

# Sampling on the device (Backend::SampleTokens in the step graph) against the host's Sampler on
# glm5_nano: bench-decode's tokens, greedy and seeded draws, with the draw in the graph, with the
# logits brought to the host, and op by op (no graph); all must be equal.
if wants sampling; then
  {
    for draw in greedy "--sampling_temperature=0.8,--sampling_top_p=0.95,--seed=7" \
                "--sampling_temperature=1.2,--sampling_top_k=40,--seed=8"; do
      flags=()
      [[ $draw != greedy ]] && IFS=, read -ra flags <<<"$draw"
      for mode in "--device_sampling=true" "--device_sampling=false" "--step_graphs=false"; do
        "$B/nq" bench-decode --model="$w/model" --release="$w/model/release" --expert-bits=2 --backend=cuda \
          --prompt-tokens=100 --decode-tokens=200 --warmup=2 --copy_mb=0 "${flags[@]}" $mode \
          --out="/tmp/sampling_${mode##*-}.json" > /tmp/sampling.log 2>&1 || { echo "$draw $mode failed"; tail -3 /tmp/sampling.log; }
        echo "$draw $mode: $(tail -1 /tmp/sampling.log | sed 's/.*H200[^:]*: //')"
      done
      python3 -c "
import json, sys
runs = {m: json.load(open(f'/tmp/sampling_{m}.json'))['tokens']
        for m in ('device_sampling=true', 'device_sampling=false', 'step_graphs=false')}
base = runs['device_sampling=false']
for m, t in runs.items():
    d = [i for i, (a, b) in enumerate(zip(t, base)) if a != b]
    print(f'  {m}: {len(t)} tokens, equal to the host sampler: {t == base}, first differences {d[:5]}')
print('  distinct tokens:', len(set(base)))"
    done
  } > "$OUT/sampling.txt" 2>&1
  echo "== sampling"; cat "$OUT/sampling.txt"
fi

# The FP8 KV cache (--kv_cache_dtype fp8) on glm5_nano: bench-decode's greedy tokens on the GPU
# (step graphs on and off) against the CPU backend's with the same packed cache, and the GPU's
# tokens/s beside the BF16 and F32 caches.
if wants kvfp8; then
  {
    for run in "cuda fp8 --step_graphs=true" "cuda fp8 --step_graphs=false" "cpu fp8 --step_graphs=true" \
               "cuda bf16 --step_graphs=true" "cuda f32 --step_graphs=true"; do
      read -r backend dtype graphs <<<"$run"
      name="${backend}_${dtype}_${graphs##*=}"
      "$B/nq" bench-decode --model="$w/model" --release="$w/model/release" --expert-bits=2 --backend=$backend \
        --prompt-tokens=300 --decode-tokens=128 --warmup=2 --copy_mb=0 --kv_cache_dtype=$dtype $graphs \
        --out="/tmp/kv_$name.json" > /tmp/kv.log 2>&1 || { echo "$run failed"; tail -3 /tmp/kv.log; }
      echo "$run: $(tail -1 /tmp/kv.log | sed 's/.*: //')"
    done
    python3 -c "
import json
runs = {n: json.load(open(f'/tmp/kv_{n}.json'))['tokens'] for n in ('cuda_fp8_true', 'cuda_fp8_false', 'cpu_fp8_true', 'cuda_bf16_true')}
base = runs['cpu_fp8_true']
for n, t in runs.items():
    d = [i for i, (a, b) in enumerate(zip(t, base)) if a != b]
    print(f'  {n}: {len(t)} tokens, equal to the CPU backend with an FP8 cache: {t == base}, first differences {d[:5]}')"
  } > "$OUT/kvfp8.txt" 2>&1
  echo "== kvfp8"; cat "$OUT/kvfp8.txt"
fi

if wants nano; then
  profile nano --model="$w/model" --release="$w/model/release" --expert-bits=2 --prompt-tokens=100 \
    --decode-tokens=2 --warmup=1
fi

if wants greedy; then
  python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$w/model" --out /tmp/greedy --only greedy,bf16,fp8 > /tmp/greedy.txt 2>&1
  python3 - > "$OUT/greedy.txt" 2>&1 <<'PY'
import json
r = json.load(open("/tmp/greedy/gpu_cluster.json"))
g = r.get("greedy")
if g is None:
    print("no greedy result:", r.get("exceptions"))
else:
    for bits, v in g["by_bits"].items():
        print(bits, "equal" if v["equal"] else "DIFFERENT", v["per_prompt_equal"], v.get("first_divergence"))
for dtype in ("bf16", "fp8"):
    b = r.get(dtype)
    print(f"{dtype}:", None if b is None else {k: b[k] for k in ("pass", "greedy_equal", "over_f32") if k in b})
PY
  cat "$OUT/greedy.txt"
fi
