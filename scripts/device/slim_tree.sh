#!/usr/bin/env bash
# The `run` tool carries the working tree (tracked + untracked, not ignored) and 64 MiB in all,
# .device included. The big test fixtures do not fit beside the binaries and no device script
# needs them, so `on` takes them out of the index and hides them (.git/info/exclude) for the
# call, and `off` puts both back. Always run `off` after the call.
#
# `on cluster` (scripts/device/run_gpu_cluster.sh, whose bundle is larger) also hides the test
# fixtures, tokenizer data and the predictor's committed traces, which only the tests read.
#
#   bash scripts/device/slim_tree.sh on [cluster] | off
#
# While the files are out, a commit would delete them from the repository (their removal is
# staged): `on` installs a pre-commit hook that refuses any commit until `off` has run.
set -euo pipefail
cd "$(dirname "$0")/../.."
big=(
  models/glm5_nano/model.safetensors
  models/glm5_nano/reference/logits.bin
  models/glm5_nano/reference/mtp_logits.bin
  models/glm5_nano/reference/mtp_logits_vllm.bin
  tests/tokenizer/data/llama3.tokenizer.json.gz
)
# `off` restores whichever were hidden.
if [[ "${2:-}" == cluster || "${1:-}" == off ]]; then
  # From HEAD: once hidden they are no longer in the index.
  mapfile -t more < <(git ls-tree -r --name-only HEAD tests/fixtures/models tests/tokenizer/data \
    bench/predictor/glm5_nano | grep -v -e '\.md$' -e '\.py$' -e '\.cc$')
  big+=("${more[@]}")
fi
readonly big
exclude="$(git rev-parse --git-path info/exclude)"
marker="$(git rev-parse --git-path nq-slim-on)"
hook="$(git rev-parse --git-path hooks/pre-commit)"
install_hook() {
  [[ -e "$hook" ]] && ! grep -q "nq-slim-on" "$hook" && return 0  # someone else's hook: leave it
  mkdir -p "$(dirname "$hook")"
  cat >"$hook" <<'HOOK'
#!/usr/bin/env bash
# Installed by scripts/device/slim_tree.sh: no commit while the big files are out of the index.
if [[ -e "$(git rev-parse --git-path nq-slim-on)" ]]; then
  echo "pre-commit: scripts/device/slim_tree.sh is on (its files' removal is staged); run it with off first" >&2
  exit 1
fi
HOOK
  chmod +x "$hook"
}
case "${1:-}" in
  on)
    install_hook
    touch "$marker"
    for f in "${big[@]}"; do
      if [[ -e "$f" ]] && git ls-files --error-unmatch "$f" >/dev/null 2>&1; then
        git rm -q --cached "$f"
        echo "/$f" >>"$exclude"
      fi
    done
    ;;
  off)
    rm -f "$marker"
    git reset -q -- "${big[@]}"
    for f in "${big[@]}"; do
      grep -vxF "/$f" "$exclude" >"$exclude.tmp" || true
      mv "$exclude.tmp" "$exclude"
    done
    ;;
  *) echo "usage: $0 on|off" >&2; exit 2 ;;
esac
