#!/usr/bin/env bash
# Issue #7's quality table: `nq kld` in every mode on glm5_nano's held-out text (the embedded
# default, served from its calibrated release), the 4-bit share of expert calls, bits per
# weight, and the MTP layer's draft acceptance. Results and the table go to OUT (default
# .run/kld); bench/README.md quotes the table.
#
#   bash bench/quality/run_kld.sh [OUT]
#   NQ_KLD_TOKENS=4096  tokens per domain (the first N of each models/glm5_nano/eval file)
#   NQ_BUILD=build/cpu  where nq and nq-streamer are built
#   NQ_ENCODE_ARGS="--codebook_refinements 0"  extra nq encode flags for OUT's release
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.run/kld}
build=${NQ_BUILD:-build/cpu}
nq=$build/services/tools/nq
per_domain=${NQ_KLD_TOKENS:-4096}
readonly window=1024 slots=8 port=8290
mkdir -p "$out/tokens"
NQ_BIN=$nq bash scripts/embedded_model.sh "$out/model" >/dev/null
model=$out/model
release=$model/release

python3 - "$per_domain" "$out/tokens" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
for d in ["stdlib_code", "stdlib_tests", "libs_code", "docstrings"]:
    ids = json.load(open(f"models/glm5_nano/eval/{d}.tokens.json"))[:n]
    json.dump(ids, open(f"{out}/{d}.json", "w"))
PY
tokens=$(ls "$out"/tokens/*.json | paste -sd, -)
kld() {
  "$nq" kld --teacher "$model" --release "$release" --tokens "$tokens" --window $window --slots $slots \
    --out "$out/$1.json" "${@:2}" --mode "$1" > "$out/$1.txt"
  echo "kld $1 done"
}
for mode in all-4-bit all-2-bit fixed-set oracle previous-block; do kld "$mode"; done

# live: through a real nq-streamer serving the release (predictor v0).
"$build/services/streamer/nq-streamer" --host=127.0.0.1 --grpc_port=$port --metrics_port=$((port + 1)) \
  --records_dir="$release" > "$out/streamer.log" 2>&1 &
streamer_pid=$!
trap 'kill $streamer_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$((port + 1))/health" >/dev/null && break; sleep 0.1; done
kld live --streamer "127.0.0.1:$port"
kill -TERM $streamer_pid; wait $streamer_pid || true
trap - EXIT

# MTP draft acceptance, full precision and served from the release.
"$nq" mtp-acceptance --model "$model" --tokens "$tokens" --window $window --out "$out/mtp.json" > "$out/mtp.txt"
for bits in 2 4; do
  "$nq" mtp-acceptance --model "$model" --release "$release" --expert_bits $bits --tokens "$tokens" \
    --window $window --out "$out/mtp_$bits.json" > "$out/mtp_$bits.txt"
done

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| mode | routed bits/weight | mean KL | median KL | p99 KL | top-1 | 4-bit share of calls | of routing weight |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for mode in ["all-2-bit", "fixed-set", "previous-block", "live", "oracle", "all-4-bit"]:
    r = json.load(open(f"{out}/{mode}.json"))
    s = r["four_bit_share"]
    print(f"| {mode} | {r['bits_per_weight']:.3f} | {r['mean_kl']:.5f} | {r['median_kl']:.5f} | {r['p99_kl']:.4f} | "
          f"{r['top1_agreement']:.4f} | {s['calls']:.3f} | {s['weight']:.3f} |")
print()
print("| domain | " + " | ".join(["all-2-bit", "fixed-set", "previous-block", "live", "oracle", "all-4-bit"]) + " |")
print("| --- |" + " ---: |" * 6)
domains = json.load(open(f"{out}/all-2-bit.json"))["domains"].keys()
for d in domains:
    row = [json.load(open(f"{out}/{m}.json"))["domains"][d]["mean_kl"]
           for m in ["all-2-bit", "fixed-set", "previous-block", "live", "oracle", "all-4-bit"]]
    print(f"| {d} | " + " | ".join(f"{v:.5f}" for v in row) + " |")
print()
for name in ["mtp", "mtp_2", "mtp_4"]:
    print(name, json.dumps(json.load(open(f"{out}/{name}.json")))[:400])
PY
