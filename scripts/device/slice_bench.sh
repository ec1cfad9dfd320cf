# Sourced by the device scripts that time a synthetic slice (B set by unpack_devspec_bundle):
#   make_bench_slice SPEC DIR LOG   # SPEC arch:layers:experts:context (make_slice.sh's arch, layers
#                                   # and experts, then the prompt length); DIR replaced (a warm
#                                   # machine may hold one of other shapes); non-zero on failure,
#                                   # LOG's tail printed
#   bench_slice BIN LOG [FLAGS...]  # $B/BIN bench-decode of that slice (BF16 matrices, 2-bit experts,
#                                   # 64 timed steps) to LOG, its JSON (tokens) beside it as LOG.json
#                                   # less .txt; prints the summary; non-zero on failure
make_bench_slice() {
  local arch layers experts
  IFS=: read -r arch layers experts SLICE_CONTEXT <<<"$1"
  SLICE_DIR="$2"
  rm -rf "$SLICE_DIR"
  if ! NQ="$B/nq" bash scripts/device/make_slice.sh "$arch" "$SLICE_DIR" "$layers" "$experts" 0 >"$3" 2>&1; then
    tail -5 "$3"
    return 1
  fi
}
bench_slice() {
  local bin="$1" log="$2" rc
  shift 2
  timeout 150 "$B/$bin" bench-decode --model="$SLICE_DIR" --release="$SLICE_DIR/release" --expert-bits=2 --backend=cuda \
    --prompt-tokens="$SLICE_CONTEXT" --decode-tokens=64 --warmup=4 --weight-dtype=bf16 --out="${log%.txt}.json" "$@" \
    >"$log" 2>&1
  rc=$?
  tail -1 "$log" | sed 's/.*GiB): //'
  return "$rc"
}
