#!/usr/bin/env bash
# Issue #16's quality rows: glm5_nano's routed experts encoded with the trellis codec
# (`nq encode --codec trellis`, the same calibration and fixed set as the embedded release),
# then `nq kld` all-2-bit, all-4-bit and live (through a real nq-streamer and predictor v0) on
# the same held-out tokens as bench/quality/run_kld.sh. Results go to OUT (default
# .run/trellis_kld); bench/README.md quotes them.
#
#   bash bench/quality/run_kld_trellis.sh [OUT]     (~40 min on 2 loaded cores: the CPU encode
#                                                     is most of it)
#   NQ_KLD_TOKENS=4096  tokens per domain;  NQ_BUILD=build/cpu  where nq and nq-streamer are built
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.run/trellis_kld}
build=${NQ_BUILD:-build/cpu}
nq=$build/services/tools/nq
per_domain=${NQ_KLD_TOKENS:-4096}
readonly window=1024 slots=8 port=8390
mkdir -p "$out/tokens"
NQ_BIN=$nq bash scripts/embedded_model.sh "$out/model" >/dev/null
model=$out/model
"$nq" calibrate --model "$model" --tokens models/glm5_nano/calibration.tokens --out "$out/calibration.h" >/dev/null
start=$(date +%s)
"$nq" encode --model "$model" --out "$out/release_trellis" --calib "$out/calibration.h" --fixed-per-layer 4 \
  --codec trellis > "$out/encode.txt" 2>&1
echo "encode: $(( $(date +%s) - start )) s" | tee "$out/encode_time.txt"

python3 - "$per_domain" "$out/tokens" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:n]
    json.dump(ids, open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
release=$out/release_trellis
for mode in all-2-bit all-4-bit; do
  "$nq" kld --teacher "$model" --release "$release" --tokens "$tokens" --window $window --slots $slots \
    --out "$out/$mode.json" --mode "$mode" > "$out/$mode.txt"
  echo "kld $mode done"
done
"$build/services/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=$port --metrics_port=$((port + 1)) \
  --records_dir="$release" > "$out/streamer.log" 2>&1 &
streamer_pid=$!
trap 'kill $streamer_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$((port + 1))/health" >/dev/null && break; sleep 0.1; done
"$nq" kld --teacher "$model" --release "$release" --tokens "$tokens" --window $window --slots $slots \
  --out "$out/live.json" --mode live --streamer "127.0.0.1:$port" > "$out/live.txt"
kill -TERM $streamer_pid; wait $streamer_pid || true
trap - EXIT
for mode in all-2-bit live all-4-bit; do tail -n 3 "$out/$mode.txt" | head -n 1 | sed "s/^| all/| $mode/"; done
