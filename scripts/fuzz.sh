#!/usr/bin/env bash
# Fuzzes one parser of untrusted input for a bounded time (libFuzzer + ASan + UBSan).
#   scripts/fuzz.sh TARGET [SECONDS]     (default 60)
#   scripts/fuzz.sh --list
# TARGET is one of the targets below (fuzz/<TARGET>_fuzzer.cc). Builds the target from the
# parser's own sources with clang-14 into build/fuzz/, runs it for SECONDS on a scratch copy of
# its committed seed corpus (fuzz/corpus/<TARGET>/), and exits non-zero on any finding: crash,
# sanitizer report, broken invariant, leak, timeout or out-of-memory. The reproducer is kept
# under build/fuzz/artifacts/<TARGET>/; replay it with `build/fuzz/<TARGET>_fuzzer FILE`.
# Needs clang-14 and libclang-rt-14-dev (CXX_FUZZ overrides the compiler); the openai_request
# and routing_report targets also need the generated protobuf code of a configured cpu build
# (build/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

# target -> "sources|pkg-config modules|extra compiler flags"
declare -A targets=(
  [safetensors_header]="services/model/safetensors_header.cc services/model/safetensors_json.cc|absl_status absl_statusor absl_strings|"
  [release_manifest]="services/format/manifest.cc services/format/file_io.cc|absl_status absl_statusor absl_strings libcrypto|"
  [rank_index]="services/format/rank_index.cc services/format/record_layout.cc services/format/manifest.cc services/format/file_io.cc services/format/xxh3_hex.cc|absl_status absl_statusor absl_strings libcrypto|"
  [model_config]="services/model/model_config.cc services/model/model_config_parse.cc services/model/model_config_validate.cc services/model/config_fields.cc services/model/rope_config.cc|absl_status absl_statusor absl_strings|"
  [openai_request]="services/router/openai_request.cc services/router/openai_logprobs.cc build/cpu/proto/gen/nq/v1/inference.pb.cc build/cpu/proto/gen/nq/v1/sampling.pb.cc|absl_status absl_statusor absl_strings protobuf|-Ibuild/cpu/proto/gen"
  [chat_render]="services/chat/render.cc services/chat/glm5_renderer.cc services/chat/deepseek_v3_renderer.cc services/chat/py_text.cc services/chat/output_parser.cc services/chat/tool_call_parsers.cc|absl_status absl_statusor absl_strings absl_flat_hash_map absl_flat_hash_set|"
  [tokenizer_json]="services/tokenizer/tokenizer.cc services/tokenizer/added_tokens.cc services/tokenizer/bpe_model.cc services/tokenizer/byte_level.cc services/tokenizer/js_regex.cc services/tokenizer/normalizer.cc services/tokenizer/post_processor.cc services/tokenizer/pre_tokenizer.cc services/tokenizer/utf8.cc|absl_status absl_statusor absl_strings absl_flat_hash_map absl_flat_hash_set absl_hash absl_synchronization libpcre2-8 icu-uc zlib|"
  [routing_report]="services/streamer/routing_report.cc services/streamer/report_order.cc services/streamer/predictor.cc services/streamer/jf_features.cc services/streamer/jf_model.cc services/model/safetensors_file.cc services/model/safetensors_header.cc services/model/safetensors_json.cc build/cpu/proto/gen/nq/v1/streamer.pb.cc|absl_status absl_statusor absl_strings protobuf|-Ibuild/cpu/proto/gen"
)
if [[ "${1:-}" == --list ]]; then
  printf '%s\n' "${!targets[@]}" | sort
  exit 0
fi
target="${1:-}"
seconds="${2:-60}"
if [[ -z "$target" || -z "${targets[$target]+x}" || ! "$seconds" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 TARGET [SECONDS]   (targets: $(printf '%s ' "${!targets[@]}"))" >&2
  exit 2
fi
cxx="${CXX_FUZZ:-clang++-14}"
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz: $cxx not found (apt-get install clang-14 libclang-rt-14-dev)" >&2
  exit 2
fi

IFS='|' read -r source_list modules extra <<<"${targets[$target]}"
read -r -a sources <<<"fuzz/${target}_fuzzer.cc $source_list"
for f in "${sources[@]}"; do
  [[ -f "$f" ]] || { echo "fuzz $target: $f missing (generated code needs a configured cpu build)" >&2; exit 2; }
done
out=build/fuzz
bin="$out/${target}_fuzzer"
mkdir -p "$out/artifacts/$target"

# Rebuild when the binary is older than any source, any header under services/, or this script.
rebuild=0
[[ -x "$bin" ]] || rebuild=1
if ((!rebuild)); then
  newer=$(find "${sources[@]}" services fuzz "$0" -newer "$bin" \( -name '*.cc' -o -name '*.h' -o -name '*.sh' \) -print -quit)
  [[ -n "$newer" ]] && rebuild=1
fi
if ((rebuild)); then
  echo "fuzz $target: building $bin"
  # Line tables only: reports keep file:line, and the build is shorter than with full debug info.
  # shellcheck disable=SC2046,SC2086  # pkg-config output and extra flags are lists
  "$cxx" -std=c++20 -gline-tables-only -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. $extra \
    "${sources[@]}" $(pkg-config --cflags --libs $modules) -o "$bin.tmp.$$"
  mv -f "$bin.tmp.$$" "$bin"
fi

corpus=$(mktemp -d "$out/corpus.XXXXXX")
trap 'rm -rf "$corpus"' EXIT
cp "fuzz/corpus/$target"/* "$corpus/"
dict=()
[[ -f "fuzz/$target.dict" ]] && dict=(-dict="fuzz/$target.dict")

echo "fuzz $target: fuzzing for ${seconds}s"
rc=0
"$bin" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
  -use_value_profile=1 "${dict[@]}" -artifact_prefix="$out/artifacts/$target/" -print_final_stats=1 || rc=$?
if ((rc != 0)); then
  echo "fuzz $target: FAILED (exit $rc); reproducer in $out/artifacts/$target/" >&2
  exit "$rc"
fi
echo "fuzz $target: no findings in ${seconds}s"
