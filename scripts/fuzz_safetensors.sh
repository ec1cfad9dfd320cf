#!/usr/bin/env bash
# Fuzzes the safetensors header parser for a bounded time.
#   scripts/fuzz_safetensors.sh [SECONDS]     (default 60)
# Builds fuzz/safetensors_header_fuzzer.cc with libFuzzer, ASan and UBSan into build/fuzz/
# (only the parser's sources, linked against Debian's Abseil), runs it for SECONDS on a
# scratch copy of the committed seed corpus, and exits non-zero on any finding: crash,
# sanitizer report, leak, timeout or out-of-memory. The reproducer is kept under
# build/fuzz/artifacts/; replay it with `build/fuzz/safetensors_header_fuzzer FILE`.
# Needs clang-14 and libclang-rt-14-dev (CXX_FUZZ overrides the compiler).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 [SECONDS]" >&2
  exit 2
fi
cxx="${CXX_FUZZ:-clang++-14}"
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz_safetensors: $cxx not found (apt-get install clang-14 libclang-rt-14-dev)" >&2
  exit 2
fi

out=build/fuzz
bin="$out/safetensors_header_fuzzer"
sources=(fuzz/safetensors_header_fuzzer.cc services/model/safetensors_header.cc
         services/model/safetensors_json.cc)
inputs=("${sources[@]}" services/model/safetensors_header.h services/model/safetensors_json.h
        services/common/status_macros.h "$0")
mkdir -p "$out/artifacts"

rebuild=0
[[ -x "$bin" ]] || rebuild=1
for f in "${inputs[@]}"; do [[ "$f" -nt "$bin" ]] && rebuild=1; done
if ((rebuild)); then
  echo "fuzz_safetensors: building $bin"
  # shellcheck disable=SC2046  # pkg-config output is a list of flags
  "$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. \
    "${sources[@]}" $(pkg-config --cflags --libs absl_status absl_statusor absl_strings) \
    -o "$bin.tmp.$$"
  mv -f "$bin.tmp.$$" "$bin"
fi

corpus=$(mktemp -d "$out/corpus.XXXXXX")
trap 'rm -rf "$corpus"' EXIT
cp fuzz/corpus/safetensors_header/* "$corpus/"

echo "fuzz_safetensors: fuzzing for ${seconds}s"
rc=0
"$bin" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
  -use_value_profile=1 -dict=fuzz/safetensors_header.dict -artifact_prefix="$out/artifacts/" \
  -print_final_stats=1 || rc=$?
if ((rc != 0)); then
  echo "fuzz_safetensors: FAILED (exit $rc); reproducer in $out/artifacts/" >&2
  exit "$rc"
fi
echo "fuzz_safetensors: no findings in ${seconds}s"
