#!/usr/bin/env bash
# Where a decode step's time goes on the H200 (issue #13): every kernel of the last decode steps
# of `nq bench-decode` under ncu (duration and DRAM bytes per kernel, clocks left alone), grouped
# by kernel, on the GLM-5-shaped slice at a 4000-token context (2-bit experts, BF16 matrices) and
# on glm5_nano. Also the slice's tokens/s with step graphs in the same call, hbm_probe's
# yardsticks, and the cluster's greedy check with the reference's top-2 margin at a divergence.
# Over the .gpu-cluster bundle (scripts/device/package_cluster.sh); .hbm/hbm_probe.py carried.
#
#   run tool: carry [".gpu-cluster", ".hbm"], command "bash scripts/device/profile_decode_step.sh"
# NQ_PROFILE_ONLY=slice|nano|greedy|hbm (comma list) limits what runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-profile-out}"
mkdir -p "$OUT"
only="${NQ_PROFILE_ONLY:-hbm,slice,nano,greedy}"
wants() { [[ ",$only," == *",$1,"* ]]; }
w=$(mktemp -d)
tar -C "$w" -xJf .gpu-cluster/bundle.tar.xz || { echo "cannot unpack .gpu-cluster/bundle.tar.xz"; exit 1; }
export LD_LIBRARY_PATH="$w/lib:$(bash scripts/device/cuda_wheel_libs.sh)"
B=$w/bin

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
  python3 scripts/device/ncu_step_table.py "/tmp/ncu_$name.csv" > "$OUT/profile_$name.txt" 2>&1
  cat "$OUT/profile_$name.txt"
}

if wants slice; then
  slice=/tmp/nq_glm5_slice
  if NQ="$B/nq" bash scripts/device/make_glm5_slice.sh "$slice" 3 8 0 > /tmp/make_slice.log 2>&1; then
    grep -E "^(synth-model|encode):" /tmp/make_slice.log
    for g in true false; do
      "$B/nq" bench-decode --model="$slice" --release="$slice/release" --expert-bits=2 --backend=cuda \
        --prompt-tokens=4000 --decode-tokens=64 --warmup=4 --weight-dtype=bf16 --step_graphs=$g > "/tmp/slice_$g.log" 2>&1
      echo "== slice ctx4000 2-bit bf16 graphs=$g: $(tail -1 /tmp/slice_$g.log)"
    done
    profile slice --model="$slice" --release="$slice/release" --expert-bits=2 --weight-dtype=bf16 \
      --prompt-tokens=4000 --decode-tokens=2 --warmup=1
  else
    echo "make_glm5_slice failed"; tail -5 /tmp/make_slice.log
  fi
fi

if wants nano; then
  profile nano --model="$w/model" --release="$w/model/release" --expert-bits=2 --prompt-tokens=100 \
    --decode-tokens=2 --warmup=1
fi

if wants greedy; then
  python3 scripts/device/gpu_cluster_check.py --bin "$B" --model "$w/model" --out /tmp/greedy --only greedy > /tmp/greedy.txt 2>&1
  python3 - > "$OUT/greedy.txt" 2>&1 <<'PY'
import json
r = json.load(open("/tmp/greedy/gpu_cluster.json"))
g = r.get("greedy")
if g is None:
    print("no greedy result:", r.get("exceptions"))
else:
    for bits, v in g["by_bits"].items():
        print(bits, "equal" if v["equal"] else "DIFFERENT", v["per_prompt_equal"], v.get("first_divergence"))
PY
  cat "$OUT/greedy.txt"
fi
