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
case "${1:-}" in
  on)
    for f in "${big[@]}"; do
      if [[ -e "$f" ]] && git ls-files --error-unmatch "$f" >/dev/null 2>&1; then
        git rm -q --cached "$f"
        echo "/$f" >>"$exclude"
      fi
    done
    ;;
  off)
    git reset -q -- "${big[@]}"
    for f in "${big[@]}"; do
      grep -vxF "/$f" "$exclude" >"$exclude.tmp" || true
      mv "$exclude.tmp" "$exclude"
    done
    ;;
  *) echo "usage: $0 on|off" >&2; exit 2 ;;
esac
