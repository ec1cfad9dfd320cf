// The layer the loader tests drive on the test release (tests/format/test_release.h,
// TestManifest): its first fixed expert, two floating experts and the first floating slot.
#pragma once

#include <cstdint>

// In nq::streamer itself, where the loader tests live: test code only includes this.
namespace nq::streamer {

inline constexpr uint32_t kLayer = 3;
inline constexpr uint32_t kFixedExpert = 2;  // TestManifest: layer 3's fixed set starts with 2
inline constexpr uint32_t kA = 3;
inline constexpr uint32_t kB = 1;
inline constexpr uint32_t kFloatingSlot = 1;

}  // namespace nq::streamer
