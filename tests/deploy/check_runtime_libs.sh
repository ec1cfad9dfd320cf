#!/usr/bin/env bash
# The Dockerfile's runtime image installs what the binaries need: every shared library that
# `ldd` resolves for the binaries of the CPU preset belongs to a package of RUNTIME_LIBS,
# to their dependencies, or to debian:12-slim itself; and every RUNTIME_LIBS package is
# needed directly and exists in Debian 12.
# Usage: check_runtime_libs.sh SOURCE_DIR BINARY...
set -euo pipefail
NQ_ROOT=${1:?usage: check_runtime_libs.sh SOURCE_DIR BINARY...}
shift
source "$(dirname "$0")/lib.sh"
need ldd dpkg-query apt-cache

runtime_libs=$(sed -n 's/^ARG RUNTIME_LIBS="\(.*\)"$/\1/p' "$NQ_ROOT/Dockerfile")
if [[ -z $runtime_libs ]]; then
  echo "Dockerfile: no ARG RUNTIME_LIBS=\"...\" line" >&2
  exit 1
fi
# What debian:12-slim already holds (Priority: required; libstdc++6 and libgcc-s1 come with apt).
base=" libc6 libgcc-s1 libstdc++6 "
# RUNTIME_LIBS and everything they pull in.
closure=" $(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
  --no-replaces --no-enhances $runtime_libs 2>/dev/null | grep -v '^ ' | tr '\n' ' ') "

status=0
needed=" "
for bin in "$@"; do
  while read -r lib; do
    pkg=$(dpkg-query -S "$lib" 2>/dev/null | head -n1 | cut -d: -f1) || true
    if [[ -z $pkg ]]; then
      # Debian 12 is merged-/usr: ldd may name /lib/... for a file dpkg owns as /usr/lib/...
      pkg=$(dpkg-query -S "/usr$lib" 2>/dev/null | head -n1 | cut -d: -f1) || true
    fi
    if [[ -z $pkg ]]; then
      echo "$(basename "$bin"): $lib belongs to no Debian package" >&2
      status=1
      continue
    fi
    needed+="$pkg "
    if [[ $base != *" $pkg "* && $closure != *" $pkg "* ]]; then
      echo "$(basename "$bin"): $lib ($pkg) is not in the Dockerfile's RUNTIME_LIBS or their dependencies" >&2
      status=1
    fi
  done < <(ldd "$bin" | awk '/=> \// { print $3 }')
done
for pkg in $runtime_libs; do
  if [[ $needed != *" $pkg "* ]]; then
    echo "Dockerfile RUNTIME_LIBS: $pkg is linked by none of the binaries" >&2
    status=1
  fi
  if ! apt-cache show "$pkg" >/dev/null 2>&1; then
    echo "Dockerfile RUNTIME_LIBS: $pkg is not a Debian 12 package" >&2
    status=1
  fi
done
if ((status == 0)); then echo "runtime libraries ok: $(wc -w <<<"$runtime_libs") packages cover $# binaries"; fi
exit $status
