#!/usr/bin/env bash
# Runs tests under AddressSanitizer + UndefinedBehaviorSanitizer (the `asan` preset: CPU backend,
# build/asan; issue #22). By default the services' concurrent code: the worker's slot runtime,
# stream writer and sampler (worker_test), the streamer's record store, bounce cache and slot
# loader (streamer_test), and the slot protocol between a real streamer and worker
# (slot_protocol_test). Any finding aborts the test that made it.
#
#   bash scripts/sanitize.sh                 # those three test binaries
#   bash scripts/sanitize.sh all             # every test (hours on a 2-core machine)
#   bash scripts/sanitize.sh TARGET...       # these test targets, all their tests
#   bash scripts/sanitize.sh tsan            # ThreadSanitizer (the `tsan` preset, build/tsan)
#   bash scripts/sanitize.sh ci              # CI's stage (scripts/test.sh runs it after the suite)
#
# ci: within CI's time on a fresh 2-core machine, a sample: ThreadSanitizer over every unit in
# tests/tsan (about 9 min from scratch, the build included), then ASan + UBSan over the
# streamer's, the release format's and the common services' tests (streamer_test, format_test,
# common_test: io_uring reads, record and index parsing, slot loading, shared memory, TLS; about
# 12 min). Both presets build at -O1, as the sanitizers' documentation advises: under ASan the
# files compile in about 0.6x the CPU time of -O2, under TSan 0.75x (bench/README.md). The parsers
# facing the outside (requests, chat, tokenizer.json, safetensors, manifests, routing reports)
# already run under ASan + UBSan in the suite itself, as the libFuzzer targets. `all` is the
# whole suite.
#
# Leak checking is off (ASAN_OPTIONS in CMakePresets.json): gRPC and Abseil keep process-wide
# singletons that LeakSanitizer reports at exit.
#
# tsan: the concurrent units that share state only through our own code (tests/tsan/
# CMakeLists.txt lists them: record store and verifier, loader events, bounce cache, slot table,
# queued stream writer), in one binary; gRPC, Abseil and protobuf are Debian's, uninstrumented,
# so code whose threads meet inside gRPC is left to ASan and the real-binary tests. absl::Mutex
# is made visible to TSan by tests/tsan/absl_mutex_tsan.cc, not suppressed. Any report fails it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_tsan() {
  cmake --preset tsan >/dev/null
  cmake --build --preset tsan -j "$(nproc)"
  ctest --preset tsan -j "$(nproc)"
}
if [[ "${1:-}" == tsan ]]; then
  run_tsan
  exit
fi
# Builds these test targets in build/asan and runs each binary whole (ctest would also run the
# suite's non-GoogleTest tests, whose programs only a full build has).
run_asan_targets() {
  cmake --build --preset asan -j "$(nproc)" --target "$@"
  for target in "$@"; do
    binary="$(find build/asan -type f -name "$target" -perm -u+x | head -n 1)"
    [[ -n "$binary" ]] || { echo "sanitize.sh: no binary for $target" >&2; exit 1; }
    echo "== $target"
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$binary" --gtest_brief=1
  done
}
cmake --preset asan >/dev/null
if [[ "${1:-}" == ci ]]; then
  run_tsan
  run_asan_targets streamer_test format_test common_test
  exit
fi
if [[ "${1:-}" == all ]]; then
  cmake --build --preset asan -j "$(nproc)"
  ctest --preset asan -j "$(nproc)"
  exit
fi
if (($#)); then
  run_asan_targets "$@"
else
  run_asan_targets worker_test streamer_test slot_protocol_test
fi
