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

# Every library the binaries resolve, and the package that owns it (one dpkg-query call;
# Debian 12 is merged-/usr, so ldd's /lib/... may be owned as /usr/lib/...).
declare -A owner=()
mapfile -t libs < <(for bin in "$@"; do ldd "$bin" | awk '/=> \// { print $3 }'; done | sort -u)
if ((${#libs[@]} == 0)); then
  echo "ldd found no shared libraries in $*" >&2
  exit 1
fi
owners() { dpkg-query -S "$@" 2>/dev/null | awk -F': ' '!/^diversion/ { split($1, p, ":"); print $2 " " p[1] }'; }
while read -r path pkg; do owner[$path]=$pkg; done < <(owners "${libs[@]}")
while read -r path pkg; do owner[${path#/usr}]=$pkg; done < <(owners "${libs[@]/#//usr}")

status=0
needed=" "
for lib in "${libs[@]}"; do
  pkg=${owner[$lib]:-}
  if [[ -z $pkg ]]; then
    echo "$lib belongs to no Debian package" >&2
    status=1
    continue
  fi
  needed+="$pkg "
  if [[ $base != *" $pkg "* && $closure != *" $pkg "* ]]; then
    echo "$lib ($pkg) is not in the Dockerfile's RUNTIME_LIBS or their dependencies" >&2
    status=1
  fi
done
for pkg in $runtime_libs; do
  if [[ $needed != *" $pkg "* ]]; then
    echo "Dockerfile RUNTIME_LIBS: $pkg is linked by none of the binaries" >&2
    status=1
  fi
done
# One apt-cache call for the whole list (slow per call); name the culprit only on failure.
if ! apt-cache show $runtime_libs >/dev/null 2>&1; then
  for pkg in $runtime_libs; do
    apt-cache show "$pkg" >/dev/null 2>&1 || echo "Dockerfile RUNTIME_LIBS: $pkg is not a Debian 12 package" >&2
  done
  status=1
fi
if ((status == 0)); then echo "runtime libraries ok: $(wc -w <<<"$runtime_libs") packages cover the ${#libs[@]} libraries of $# binaries"; fi
exit $status
