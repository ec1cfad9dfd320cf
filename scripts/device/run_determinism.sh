#!/usr/bin/env bash
# One device call for issue #15's open question: are op-by-op CUDA decode steps deterministic
# from run to run, and if not, which switch makes them so? Greedy `nq bench-decode` on glm5_nano
# and its release (the cluster bundle, package_cluster.sh), NQ_RUNS runs per variant, tokens
# compared with the first run of the variant (compare_tokens.sh); then compute-sanitizer
# (initcheck: reads of memory nothing wrote; synccheck) on a short op-by-op run. Then the cluster
# (gpu_cluster_check.py --only spec, its fixed expert set): greedy texts of two runs per worker
# configuration, N = 0 and NQ_SPEC_DRAFTS drafts: op by op with side streams, op by op without,
# and in step graphs.
#
#   run tool: carry [".gpu-cluster"], command "bash scripts/device/run_determinism.sh"
#   NQ_TOKENS (default 256) decode steps per run; NQ_VARIANTS words of comma-joined flags;
#   NQ_SANITIZE=0 skips the sanitizer runs, NQ_SPEC=0 the cluster runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then exec > >(tee "$OUT/determinism_log.txt") 2>&1; fi
source scripts/device/unpack_cluster_bundle.sh
source scripts/device/compare_tokens.sh
out="${OUT:-$(mktemp -d)}"
runs="${NQ_RUNS:-3}"
tokens="${NQ_TOKENS:-256}"
variants="${NQ_VARIANTS:---step_graphs=true --step_graphs=false --step_graphs=false,--side_streams=false}"
bench=("$work/bin/nq" bench-decode --model="$work/model" --release="$work/model/release" --expert-bits=2
  --backend=cuda --prompt_tokens=64 --warmup=0 --copy_mb=0)
status=0
v=0
for variant in $variants; do
  v=$((v + 1))
  IFS=, read -r -a flags <<<"$variant"
  files=()
  for r in $(seq 1 "$runs"); do
    f="$out/v${v}_run$r.json"
    "${bench[@]}" --decode_tokens="$tokens" "${flags[@]}" --out="$f" >"$out/v${v}_run$r.log" 2>&1 || {
      echo "bench-decode $variant run $r failed:"; tail -5 "$out/v${v}_run$r.log"; status=1; }
    files+=("$f")
  done
  echo "== $variant: $(tail -1 "$out/v${v}_run1.log")"
  compare_tokens "${files[@]}"
done
if [[ "${NQ_SANITIZE:-1}" == 1 ]]; then
  for tool in initcheck synccheck; do
    echo "== compute-sanitizer --tool $tool, op by op, 24 steps"
    compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 100000 --log-file "$out/san_$tool.log" \
      "${bench[@]}" --decode_tokens=24 --step_graphs=false --out="$out/san_$tool.json" >/dev/null 2>&1
    echo "exit $?"; grep -E "ERROR SUMMARY" "$out/san_$tool.log"
    # Errors per kind and source line, most frequent first.
    grep -A1 -E "^========= [A-Z]" "$out/san_$tool.log" | grep -E "^=========     at " | sed -E 's/\+0x[0-9a-f]+//' |
      sort | uniq -c | sort -rn | head -20
    gzip -f "$out/san_$tool.log"
  done
fi
if [[ "${NQ_SPEC:-1}" == 1 ]]; then
  drafts="${NQ_SPEC_DRAFTS:-3}"
  configs=("--step_graphs=false" "--step_graphs=false --side_streams=false" "--step_graphs=true")
  for c in "${!configs[@]}"; do
    for r in 1 2; do
      timeout 150 python3 scripts/device/gpu_cluster_check.py --bin "$work/bin" --model "$work/model" \
        --out "$out/spec_c${c}_r$r" --backend cuda --only spec --spec-drafts "0,$drafts" --spec-warmup-tokens 300 \
        --spec-worker-flags="${configs[$c]}" >"$out/spec_c${c}_r$r.txt" 2>&1 || status=1
    done
  done
  python3 - "$out" "$drafts" "${configs[@]}" <<'PY'
import glob, json, sys
out, drafts, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
for c, flags in enumerate(configs):
    texts = []
    for r in (1, 2):
        found = sorted(glob.glob(f"{out}/spec_c{c}_r{r}/*.json")) + sorted(glob.glob(f"{out}/spec_c{c}_r{r}*.json"))
        try:
            rows = json.load(open(found[0]))["spec"]["by_drafts"]
            texts.append({n: rows[n]["greedy_texts"] for n in rows})
        except Exception as e:  # a failed run: say so, compare the rest
            print(f"== worker flags '{flags}' run {r}: no report ({e})")
            texts.append(None)
    if None in texts:
        continue
    same_n0 = texts[0]["0"] == texts[1]["0"]
    n_vs_0 = [texts[r][drafts] == texts[r]["0"] for r in (0, 1)]
    print(f"== worker flags '{flags}': N=0 texts equal across runs: {same_n0}; N={drafts} equal to N=0 "
          f"in run 1, 2: {n_vs_0}; N=0 lengths {[len(t) for t in texts[0]['0']]} / {[len(t) for t in texts[1]['0']]}")
PY
fi
exit "$status"
