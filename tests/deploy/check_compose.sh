#!/usr/bin/env bash
# Debian's docker-compose accepts deploy/compose.yaml with the default profile and with
# `--profile cpu`; check_compose.mjs checks what each profile enables, and check_flags.mjs
# the service flags. Run from another directory: deploy/.env is found beside the file.
# (Compose 1.29's config lists every service whatever the profile; check_compose.mjs
# resolves the profiles itself, by the Compose spec's rules.)
# Usage: check_compose.sh SOURCE_DIR NQ_ROUTER NQ_STREAMER NQ_WORKER NQ
set -euo pipefail
NQ_ROOT=${1:?usage: check_compose.sh SOURCE_DIR NQ_ROUTER NQ_STREAMER NQ_WORKER NQ}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
need docker-compose node
need_node_modules
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# Variables from the caller's shell (COMPOSE_*, NQ_*) would change the result: none pass.
compose() { env -i PATH="$PATH" HOME="$HOME" docker-compose -f "$NQ_ROOT/deploy/compose.yaml" "$@"; }
compose --version
compose config --quiet
compose config >"$work/default.yaml"
compose --profile cpu config --quiet
node "$here/check_compose.mjs" "$NQ_ROOT" "$work/default.yaml"
node "$here/check_flags.mjs" "$2" "$3" "$4" "$work/default.yaml"
