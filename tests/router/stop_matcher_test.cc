#include "services/router/stop_matcher.h"

#include <gtest/gtest.h>

namespace nq::router {
namespace {

TEST(StopMatcherTest, PassesTextThroughWithoutStops) {
  StopMatcher m({});
  EXPECT_EQ(m.Feed("abc"), "abc");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, HoldsAPossibleStartAndReleasesItWhenItIsNot) {
  StopMatcher m({"###"});
  EXPECT_EQ(m.Feed("hello #"), "hello ");
  EXPECT_EQ(m.Feed("#"), "");
  EXPECT_EQ(m.Feed("x"), "##x");
  EXPECT_FALSE(m.matched());
}

TEST(StopMatcherTest, StopsAcrossChunksAndDropsTheRest) {
  StopMatcher m({"END", "stop"});
  EXPECT_EQ(m.Feed("one two E"), "one two ");
  EXPECT_EQ(m.Feed("NDthree"), "");
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.matched_stop(), "END");
  EXPECT_EQ(m.Feed("more"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, EarliestStopWinsAndMultibyteStaysWhole) {
  StopMatcher m({"world", "안녕"});
  EXPECT_EQ(m.Feed("say 안"), "say ");
  EXPECT_EQ(m.Feed("녕 world"), "");
  EXPECT_EQ(m.matched_stop(), "안녕");
}

TEST(StopMatcherTest, FlushReleasesHeldText) {
  StopMatcher m({"<eos>"});
  EXPECT_EQ(m.Feed("tail <eo"), "tail ");
  EXPECT_EQ(m.Flush(), "<eo");
}

}  // namespace
}  // namespace nq::router
