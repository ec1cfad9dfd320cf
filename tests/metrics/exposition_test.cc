// Exact-text golden tests of the Prometheus text format 0.0.4 written by Registry::Serialize.
#include "services/common/metrics/exposition.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#include "gtest/gtest.h"
#include "services/common/metrics/registry.h"

namespace nq::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(ExpositionTest, UnlabelledCounterExposesZeroBeforeFirstIncrement) {
  Registry registry;
  registry.Counter("nq_requests_total", "Requests served.");
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_requests_total Requests served.
# TYPE nq_requests_total counter
nq_requests_total 0
)");
}

TEST(ExpositionTest, LabelledCounter) {
  Registry registry;
  auto& family = registry.Counter("nq_request_success_total", "Finished requests.",
                                  {"finished_reason", "model"});
  family.WithLabels({"stop", "llama"}).Increment(3);
  family.WithLabels({"length", "llama"}).Increment(0.5);
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_request_success_total Finished requests.
# TYPE nq_request_success_total counter
nq_request_success_total{finished_reason="length",model="llama"} 0.5
nq_request_success_total{finished_reason="stop",model="llama"} 3
)");
}

TEST(ExpositionTest, LabelledFamilyWithoutChildrenWritesOnlyHeader) {
  Registry registry;
  registry.Counter("nq_expert_calls_total", "Expert calls.", {"bits"});
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_expert_calls_total Expert calls.
# TYPE nq_expert_calls_total counter
)");
}

TEST(ExpositionTest, Gauge) {
  Registry registry;
  registry.Gauge("nq_num_requests_running", "Requests running.").Get().Set(7);
  auto& depth = registry.Gauge("nq_streamer_read_queue_depth", "Queue depth.", {"rank"});
  depth.WithLabels({"1"}).Set(-2.5);
  depth.WithLabels({"0"}).Set(1e21);
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_num_requests_running Requests running.
# TYPE nq_num_requests_running gauge
nq_num_requests_running 7
# HELP nq_streamer_read_queue_depth Queue depth.
# TYPE nq_streamer_read_queue_depth gauge
nq_streamer_read_queue_depth{rank="0"} 1e+21
nq_streamer_read_queue_depth{rank="1"} -2.5
)");
}

TEST(ExpositionTest, NonFiniteValues) {
  Registry registry;
  auto& family = registry.Gauge("nq_values", "Values.", {"kind"});
  family.WithLabels({"nan"}).Set(std::nan(""));
  family.WithLabels({"neg"}).Set(-kInf);
  family.WithLabels({"pos"}).Set(kInf);
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_values Values.
# TYPE nq_values gauge
nq_values{kind="nan"} NaN
nq_values{kind="neg"} -Inf
nq_values{kind="pos"} +Inf
)");
}

TEST(ExpositionTest, UnlabelledHistogram) {
  Registry registry;
  auto& histogram =
      registry.Histogram("nq_e2e_request_latency_seconds", "Latency.", {0.1, 1, 10}).Get();
  histogram.Observe(0.05);
  histogram.Observe(0.5);
  histogram.Observe(0.7);
  histogram.Observe(20);
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_e2e_request_latency_seconds Latency.
# TYPE nq_e2e_request_latency_seconds histogram
nq_e2e_request_latency_seconds_bucket{le="0.1"} 1
nq_e2e_request_latency_seconds_bucket{le="1"} 3
nq_e2e_request_latency_seconds_bucket{le="10"} 3
nq_e2e_request_latency_seconds_bucket{le="+Inf"} 4
nq_e2e_request_latency_seconds_sum 21.25
nq_e2e_request_latency_seconds_count 4
)");
}

TEST(ExpositionTest, FreshUnlabelledHistogramExposesZeros) {
  Registry registry;
  registry.Histogram("nq_queue_time_seconds", "Queue time.", {0.5});
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_queue_time_seconds Queue time.
# TYPE nq_queue_time_seconds histogram
nq_queue_time_seconds_bucket{le="0.5"} 0
nq_queue_time_seconds_bucket{le="+Inf"} 0
nq_queue_time_seconds_sum 0
nq_queue_time_seconds_count 0
)");
}

TEST(ExpositionTest, LabelledHistogramPutsLeLast) {
  Registry registry;
  auto& family = registry.Histogram("nq_read_seconds", "Reads.", {0.25, 2.5}, {"model"});
  family.WithLabels({"b"}).Observe(3);
  family.WithLabels({"a"}).Observe(0.25);
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_read_seconds Reads.
# TYPE nq_read_seconds histogram
nq_read_seconds_bucket{model="a",le="0.25"} 1
nq_read_seconds_bucket{model="a",le="2.5"} 1
nq_read_seconds_bucket{model="a",le="+Inf"} 1
nq_read_seconds_sum{model="a"} 0.25
nq_read_seconds_count{model="a"} 1
nq_read_seconds_bucket{model="b",le="0.25"} 0
nq_read_seconds_bucket{model="b",le="2.5"} 0
nq_read_seconds_bucket{model="b",le="+Inf"} 1
nq_read_seconds_sum{model="b"} 3
nq_read_seconds_count{model="b"} 1
)");
}

TEST(ExpositionTest, EscapesHelpText) {
  Registry registry;
  registry.Gauge("nq_g", "Back\\slash, \"quotes\" stay,\nnew line.");
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_g Back\\slash, "quotes" stay,\nnew line.
# TYPE nq_g gauge
nq_g 0
)");
}

TEST(ExpositionTest, EscapesLabelValues) {
  Registry registry;
  registry.Counter("nq_c_total", "C.", {"path"}).WithLabels({"a\\b\"c\nd"}).Increment();
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_c_total C.
# TYPE nq_c_total counter
nq_c_total{path="a\\b\"c\nd"} 1
)");
}

TEST(ExpositionTest, SortsFamiliesByNameAndChildrenByLabelValues) {
  Registry registry;
  registry.Gauge("nq_b", "B.", {"x", "y"});
  registry.Gauge("nq_b", "B.", {"x", "y"}).WithLabels({"2", "a"}).Set(1);
  registry.Gauge("nq_b", "B.", {"x", "y"}).WithLabels({"10", "z"}).Set(2);
  registry.Gauge("nq_b", "B.", {"x", "y"}).WithLabels({"10", "b"}).Set(3);
  registry.Counter("nq_a_total", "A.");
  // Label values sort as strings, first label first: "10" < "2".
  EXPECT_EQ(registry.Serialize(), R"(# HELP nq_a_total A.
# TYPE nq_a_total counter
nq_a_total 0
# HELP nq_b B.
# TYPE nq_b gauge
nq_b{x="10",y="b"} 3
nq_b{x="10",y="z"} 2
nq_b{x="2",y="a"} 1
)");
}

TEST(FormatValueTest, ShortestRoundTrip) {
  EXPECT_EQ(internal::FormatValue(0), "0");
  EXPECT_EQ(internal::FormatValue(1), "1");
  EXPECT_EQ(internal::FormatValue(-7), "-7");
  EXPECT_EQ(internal::FormatValue(0.1), "0.1");
  EXPECT_EQ(internal::FormatValue(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(internal::FormatValue(123456789), "123456789");
  EXPECT_EQ(internal::FormatValue(1e-7), "1e-07");
  EXPECT_EQ(internal::FormatValue(kInf), "+Inf");
  EXPECT_EQ(internal::FormatValue(-kInf), "-Inf");
  EXPECT_EQ(internal::FormatValue(std::nan("")), "NaN");
}

TEST(FormatValueTest, RoundTripsExactly) {
  for (double v : {1.0 / 3, 2.0 / 3, 1e300, 5e-324, 9007199254740993.0, 0.30000000000000004}) {
    EXPECT_EQ(std::strtod(internal::FormatValue(v).c_str(), nullptr), v);
  }
}

TEST(EscapeTest, ValidUtf8PassesThrough) {
  EXPECT_EQ(internal::EscapeLabelValue("größe 模型 🚀"), "größe 模型 🚀");
}

TEST(EscapeTest, InvalidUtf8BecomesReplacementCharacter) {
  // A stray continuation byte, an overlong '/', a surrogate and a truncated sequence.
  EXPECT_EQ(internal::EscapeLabelValue("a\x80"
                                       "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(internal::EscapeLabelValue("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(internal::EscapeLabelValue("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(internal::EscapeHelp("ok\xE6\xA8"), "ok\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(ContentTypeTest, IsTextFormat004) {
  EXPECT_STREQ(kContentType, "text/plain; version=0.0.4; charset=utf-8");
}

}  // namespace
}  // namespace nq::metrics
