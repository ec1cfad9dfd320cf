// PinnedRanges (kernels/cuda/pinned_ranges.h): which host ranges a CUDA backend may write with a
// kernel. Pure host code, so it is tested here, where CI runs it.
#include "kernels/cuda/pinned_ranges.h"

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace nq::kernels::cuda {
namespace {

TEST(PinnedRanges, ContainsOnlyWhatLiesWhollyInsideOneRange) {
  std::vector<std::byte> memory(1000);
  std::byte* a = memory.data() + 100;  // [100, 300)
  std::byte* b = memory.data() + 300;  // [300, 400), adjacent to a
  PinnedRanges ranges;
  EXPECT_FALSE(ranges.Contains(a, 1));
  ranges.Add(a, 200);
  ranges.Add(b, 100);
  EXPECT_TRUE(ranges.Contains(a, 200));
  EXPECT_TRUE(ranges.Contains(a + 199, 1));
  EXPECT_TRUE(ranges.Contains(a + 200, 0));
  EXPECT_TRUE(ranges.Contains(b + 50, 50));
  EXPECT_FALSE(ranges.Contains(a, 201)) << "straddles two ranges";
  EXPECT_FALSE(ranges.Contains(a + 150, 100)) << "straddles two ranges";
  EXPECT_FALSE(ranges.Contains(a - 1, 2)) << "starts before the first range";
  EXPECT_FALSE(ranges.Contains(memory.data(), 1));
  EXPECT_FALSE(ranges.Contains(b + 100, 1)) << "past the last range";
  EXPECT_FALSE(ranges.Contains(b + 50, 51));
}

TEST(PinnedRanges, ARemovedRangeIsForgotten) {
  std::vector<std::byte> memory(64);
  PinnedRanges ranges;
  ranges.Add(memory.data(), 32);
  ranges.Add(memory.data() + 32, 32);
  ranges.Remove(memory.data());
  EXPECT_FALSE(ranges.Contains(memory.data(), 1));
  EXPECT_TRUE(ranges.Contains(memory.data() + 32, 32));
  ranges.Remove(memory.data() + 32);
  EXPECT_FALSE(ranges.Contains(memory.data() + 32, 1));
}

}  // namespace
}  // namespace nq::kernels::cuda
