// BounceCache (services/streamer/bounce_cache.h): which buffer a read takes, which record a
// lookup finds, and that only a filled buffer is ever found.
#include "services/streamer/bounce_cache.h"

#include <gtest/gtest.h>

#include <vector>

namespace nq::streamer {
namespace {

constexpr RecordKey kA{.rank = 0, .layer = 3, .expert = 1};
constexpr RecordKey kB{.rank = 0, .layer = 3, .expert = 2};
constexpr RecordKey kC{.rank = 0, .layer = 4, .expert = 1};

TEST(BounceCacheTest, FilledRecordIsFoundAndOthersAreNot) {
  const std::vector<unsigned> buffers = {7, 9};
  BounceCache cache(buffers);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_FALSE(cache.Lookup(kA).has_value());
  std::optional<unsigned> b = cache.AcquireForRead();
  ASSERT_TRUE(b.has_value());
  EXPECT_TRUE(*b == 7 || *b == 9);
  EXPECT_FALSE(cache.Contains(kA)) << "a buffer being read into is not a record yet";
  cache.Fill(*b, kA);
  EXPECT_TRUE(cache.Contains(kA));
  EXPECT_EQ(cache.Lookup(kA), b);
  EXPECT_FALSE(cache.Lookup(kB).has_value());
  // Same layer and expert of another rank is another record.
  EXPECT_FALSE(cache.Lookup(RecordKey{.rank = 1, .layer = 3, .expert = 1}).has_value());
  EXPECT_EQ(cache.records(), 1u);
  EXPECT_EQ(cache.idle(), 2u);
}

TEST(BounceCacheTest, DiscardedReadIsNeverFound) {
  const std::vector<unsigned> buffers = {0};
  BounceCache cache(buffers);
  unsigned b = *cache.AcquireForRead();
  cache.Fill(b, kA);
  // The buffer is taken for a read of kB that fails: kA's record there is gone and kB never
  // becomes one.
  EXPECT_EQ(cache.AcquireForRead(), b);
  EXPECT_FALSE(cache.Contains(kA));
  cache.Discard(b);
  EXPECT_FALSE(cache.Contains(kA));
  EXPECT_FALSE(cache.Contains(kB));
  EXPECT_EQ(cache.records(), 0u);
  EXPECT_EQ(cache.idle(), 1u);
}

TEST(BounceCacheTest, ReadsTakeEmptyBuffersFirstThenTheLeastRecentlyUsed) {
  const std::vector<unsigned> buffers = {0, 1, 2};
  BounceCache cache(buffers);
  const unsigned a = *cache.AcquireForRead();
  cache.Fill(a, kA);
  const unsigned b = *cache.AcquireForRead();
  EXPECT_NE(b, a) << "an empty buffer goes before one holding a record";
  cache.Fill(b, kB);
  const unsigned c = *cache.AcquireForRead();
  EXPECT_NE(c, a);
  EXPECT_NE(c, b);
  cache.Fill(c, kC);
  // kA is used again: kB is now the least recently used and goes first.
  ASSERT_TRUE(cache.Lookup(kA).has_value());
  EXPECT_EQ(cache.AcquireForRead(), b);
  EXPECT_FALSE(cache.Contains(kB));
  EXPECT_TRUE(cache.Contains(kA));
  EXPECT_TRUE(cache.Contains(kC));
  // A discarded buffer is empty again and the next to go, before kC's and kA's.
  cache.Discard(b);
  EXPECT_EQ(cache.AcquireForRead(), b);
  EXPECT_EQ(cache.AcquireForRead(), c);  // kC is older than kA's lookup
  EXPECT_EQ(cache.AcquireForRead(), a);
  EXPECT_FALSE(cache.AcquireForRead().has_value()) << "every buffer is busy";
  EXPECT_EQ(cache.idle(), 0u);
}

TEST(BounceCacheTest, ARecordIsHeldOnceAndBusyBuffersAreNeverFound) {
  const std::vector<unsigned> buffers = {0, 1};
  BounceCache cache(buffers);
  const unsigned first = *cache.AcquireForRead();
  const unsigned second = *cache.AcquireForRead();
  cache.Fill(first, kA);
  cache.Fill(second, kA);  // a second read of kA (the first was cancelled but landed)
  EXPECT_EQ(cache.records(), 1u);
  EXPECT_EQ(cache.Lookup(kA), second);
  // Filling a buffer that no read was taken for is refused: nothing becomes a record.
  cache.Fill(first, kB);
  EXPECT_FALSE(cache.Contains(kB));
}

}  // namespace
}  // namespace nq::streamer
