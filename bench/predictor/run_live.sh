#!/usr/bin/env bash
# `nq kld --mode live` on glm5_nano's held-out text (the quality table's 16,384 tokens, windows
# of 1024, F = 8) through a real nq-streamer, once per predictor given: "v0" or a jF model file.
# Results (kld JSON, text, streamer log) go to OUT/<name>/; a summary table is printed.
#
#   bash bench/predictor/run_live.sh OUT v0 bench/predictor/glm5_nano/jf/model.safetensors
#   NQ_BUILD=build/cpu  where nq and nq-streamer are built
#   NQ_STREAMER_ARGS    extra nq-streamer flags (e.g. --hysteresis=0.5)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?OUT}
shift
build=${NQ_BUILD:-build/cpu}
nq=$build/services/tools/nq
readonly window=1024 slots=8 port=8390
mkdir -p "$out/tokens"
NQ_BIN=$nq bash scripts/embedded_model.sh .run/embedded >/dev/null
model=.run/embedded
release=$model/release
python3 - "$out/tokens" <<'PY'
import json, sys
out = sys.argv[1]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:4096]
    json.dump(ids, open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
names=()
for predictor in "$@"; do
  name=$([[ "$predictor" == v0 ]] && echo v0 || basename "$(dirname "$predictor")")
  names+=("$name")
  mkdir -p "$out/$name"
  flags=()
  [[ "$predictor" != v0 ]] && flags+=("--predictor=$predictor")
  "$build/services/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=$port --metrics_port=$((port + 1)) \
    --records_dir="$release" "${flags[@]}" ${NQ_STREAMER_ARGS:-} > "$out/$name/streamer.log" 2>&1 &
  streamer_pid=$!
  trap 'kill $streamer_pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$((port + 1))/health" >/dev/null && break; sleep 0.1; done
  "$nq" kld --teacher "$model" --release "$release" --tokens "$tokens" --window $window --slots $slots \
    --out "$out/$name/live.json" --mode live --streamer "127.0.0.1:$port" > "$out/$name/live.txt"
  kill -TERM $streamer_pid; wait $streamer_pid || true
  trap - EXIT
done
python3 - "$out" "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
print("| predictor | mean KL | median KL | p99 KL | top-1 | 4-bit share of calls | of routing weight |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for n in names:
    r = json.load(open(f"{out}/{n}/live.json"))
    s = r["four_bit_share"]
    print(f"| {n} | {r['mean_kl']:.5f} | {r['median_kl']:.5f} | {r['p99_kl']:.4f} | {r['top1_agreement']:.4f} | "
          f"{s['calls']:.3f} | {s['weight']:.3f} |")
PY
