#!/usr/bin/env bash
# One device call for the decode-step graphs (issue #13): over the .gpu-cluster bundle
# (scripts/device/package_cluster.sh with NQ_EXTRA_BINS="cuda_vs_cpu_ops_test=..."):
#  - the device-position ops and graph capture against the CPU (CudaStepPosition*), plain and
#    under compute-sanitizer memcheck with the other decode-step op tests;
#  - memcheck over real graph replays (nq bench-decode, 8 steps);
#  - bench-decode's greedy tokens with graphs on and off (300 steps over the first buckets);
#  - the cluster's greedy check against a CPU worker with graphs on, then off.
# Few files land in $OUT (the run tool brings back a limited number).
#
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_step_graphs.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/nq-step-graphs-out}"
mkdir -p "$OUT"
w=$(mktemp -d)
tar -C "$w" -xJf .gpu-cluster/bundle.tar.xz || { echo "cannot unpack .gpu-cluster/bundle.tar.xz"; exit 1; }
export LD_LIBRARY_PATH="$w/lib:$(bash scripts/device/cuda_wheel_libs.sh)"
B=$w/bin
M=$w/model
$B/cuda_vs_cpu_ops_test --gtest_filter='CudaStepPosition*' > $OUT/ops.txt 2>&1; echo ops rc $?
compute-sanitizer --tool memcheck $B/cuda_vs_cpu_ops_test --gtest_filter='CudaStepPosition*:CudaMoeRoute*:CudaCopyToHostAsync*:CudaMlaDecode*:CudaEmbedding*:CudaRope*' > $OUT/memcheck.txt 2>&1; echo memcheck rc $?; tail -3 $OUT/memcheck.txt
compute-sanitizer --tool memcheck $B/nq bench-decode --model=$M --release=$M/release --expert-bits=2 --backend=cuda --decode-tokens=8 --warmup=2 --prompt-tokens=16 --copy_mb=0 > $OUT/memcheck_bench.txt 2>&1; echo memcheck bench rc $?; tail -4 $OUT/memcheck_bench.txt
for g in true false; do $B/nq bench-decode --model=$M --release=$M/release --expert-bits=2 --backend=cuda --decode-tokens=300 --warmup=2 --prompt-tokens=100 --step_graphs=$g --out=/tmp/b_$g.json > /tmp/b_$g.log 2>&1; grep "step graphs" /tmp/b_$g.log; done
python3 -c "
import json;a=json.load(open('/tmp/b_true.json'));b=json.load(open('/tmp/b_false.json'))
ta=a.get('tokens');tb=b.get('tokens');print('keys',list(a)[:20]);
d=[i for i,(x,y) in enumerate(zip(ta,tb)) if x!=y] if ta else None;print('tokens equal',ta==tb,'first diff',d[:5] if d else d)" > $OUT/tokens.txt 2>&1; cat $OUT/tokens.txt
python3 scripts/device/gpu_cluster_check.py --bin $B --model $M --out /tmp/g1 --only greedy > /tmp/g1.txt 2>&1; python3 -c "
import json;r=json.load(open('/tmp/g1/gpu_cluster.json'))['greedy']
for b,v in r['by_bits'].items():
  print(b,v['equal'],v['per_prompt_equal'])
  for x,y in zip(v['cpu'],v['cuda']):
    if x!=y: print(' cpu ',repr(x[:300]));print(' cuda',repr(y[:300]))" > $OUT/greedy_on.txt 2>&1; cat $OUT/greedy_on.txt
python3 scripts/device/gpu_cluster_check.py --bin $B --model $M --out /tmp/g2 --only greedy --test-worker-flags=--step_graphs=false > /tmp/g2.txt 2>&1; python3 -c "
import json;r=json.load(open('/tmp/g2/gpu_cluster.json'))['greedy']
print({b:v['per_prompt_equal'] for b,v in r['by_bits'].items()})" > $OUT/greedy_off.txt 2>&1; cat $OUT/greedy_off.txt
