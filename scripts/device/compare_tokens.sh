# Sourced by the device scripts: compare_tokens base.json other.json... prints whether the tokens
# of each bench-decode run (its --out file) equal the first one's, and where they first differ;
# non-zero when any differs.
compare_tokens() {
  python3 - "$@" <<'PY'
import json, sys
runs = {p: json.load(open(p))['tokens'] for p in sys.argv[1:]}
base = runs[sys.argv[1]]
for p, t in runs.items():
    d = [i for i, (a, b) in enumerate(zip(t, base)) if a != b]
    print(f'  {p}: {len(t)} tokens, equal to {sys.argv[1]}: {t == base}, first differences {d[:5]}')
sys.exit(0 if all(t == base for t in runs.values()) else 1)
PY
}
