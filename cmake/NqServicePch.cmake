# A precompiled header for the largest service libraries (nq_common, nq_streamer_lib,
# nq_worker_lib, nq_router_lib, some 90 files): gRPC, protobuf, spdlog, the Abseil headers most of
# their files include, and the standard headers they share. Parsing those is about 40 % of a
# file's compile at -O2; with the PCH nq_common and nq_streamer_lib compiled in 405 CPU seconds
# instead of 515 on this 2-core VM, their PCHs included (bench/README.md, "Sanitizers in CI").
# Only system headers go in, so a change to the project rebuilds no PCH. Each library builds its
# own (a few seconds): their private definitions differ, and GCC uses a PCH only for compiles whose
# flags match the ones it was built with. Their sources are all C++ (a CUDA file would need the
# headers kept to C++).
function(nq_use_service_pch target)
  target_precompile_headers(${target} PRIVATE
    <grpcpp/grpcpp.h> <google/protobuf/message.h> <spdlog/spdlog.h>
    <absl/status/status.h> <absl/status/statusor.h> <absl/strings/str_cat.h> <absl/strings/str_format.h>
    <absl/synchronization/mutex.h>
    <algorithm> <atomic> <chrono> <cstdint> <cstring> <deque> <functional> <map> <memory> <optional>
    <random> <span> <string> <thread> <utility> <vector>)
endfunction()
