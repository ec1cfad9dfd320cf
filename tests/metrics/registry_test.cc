#include "services/common/metrics/registry.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace nq::metrics {
namespace {

using ::testing::HasSubstr;

TEST(RegistryTest, SameCounterRegistrationReturnsSameFamily) {
  Registry registry;
  CounterFamily& first = registry.Counter("nq_x_total", "X.", {"a"});
  CounterFamily& second = registry.Counter("nq_x_total", "X.", {"a"});
  EXPECT_EQ(&first, &second);
}

TEST(RegistryTest, SameGaugeRegistrationReturnsSameFamily) {
  Registry registry;
  EXPECT_EQ(&registry.Gauge("nq_g", "G."), &registry.Gauge("nq_g", "G."));
}

TEST(RegistryTest, SameHistogramRegistrationReturnsSameFamily) {
  Registry registry;
  HistogramFamily& first = registry.Histogram("nq_h_seconds", "H.", {1, 2}, {"a"});
  HistogramFamily& second = registry.Histogram("nq_h_seconds", "H.", {1, 2}, {"a"});
  EXPECT_EQ(&first, &second);
  EXPECT_EQ(first.options().bucket_upper_bounds, std::vector<double>({1, 2}));
}

TEST(RegistryTest, LaterHelpTextIsIgnored) {
  Registry registry;
  registry.Gauge("nq_g", "First.");
  registry.Gauge("nq_g", "Second.");
  EXPECT_THAT(registry.Serialize(), HasSubstr("# HELP nq_g First.\n"));
}

TEST(RegistryTest, FamilyExposesItsDefinition) {
  Registry registry;
  CounterFamily& family = registry.Counter("nq_x_total", "X help.", {"a", "b"});
  EXPECT_EQ(family.name(), "nq_x_total");
  EXPECT_EQ(family.help(), "X help.");
  EXPECT_EQ(family.type(), MetricType::kCounter);
  EXPECT_EQ(family.label_names(), std::vector<std::string>({"a", "b"}));
}

TEST(RegistryTest, WithLabelsReturnsStableChildPerValueCombination) {
  Registry registry;
  CounterFamily& family = registry.Counter("nq_x_total", "X.", {"a", "b"});
  Counter& one = family.WithLabels({"1", "2"});
  Counter& other = family.WithLabels({"2", "1"});
  EXPECT_NE(&one, &other);
  for (int i = 0; i < 100; ++i) family.WithLabels({"v", std::to_string(i)});
  EXPECT_EQ(&family.WithLabels({"1", "2"}), &one);
  one.Increment(5);
  EXPECT_EQ(family.WithLabels({"1", "2"}).Value(), 5);
  EXPECT_EQ(other.Value(), 0);
}

TEST(RegistryTest, GetIsTheUnlabelledChild) {
  Registry registry;
  GaugeFamily& family = registry.Gauge("nq_g", "G.");
  EXPECT_EQ(&family.Get(), &family.WithLabels({}));
}

TEST(RegistryTest, RegistriesAreIndependent) {
  Registry a;
  Registry b;
  a.Counter("nq_x_total", "X.").Get().Increment();
  EXPECT_EQ(b.Counter("nq_x_total", "X.").Get().Value(), 0);
  EXPECT_EQ(b.Serialize().find("nq_x_total 1"), std::string::npos);
}

TEST(RegistryTest, EmptyRegistrySerializesToNothing) {
  Registry registry;
  EXPECT_EQ(registry.Serialize(), "");
}

TEST(RegistryTest, DefaultIsOneInstance) {
  EXPECT_EQ(&Registry::Default(), &Registry::Default());
  Registry::Default().Counter("nq_registry_test_default_total", "Default.").Get().Increment();
  EXPECT_THAT(Registry::Default().Serialize(), HasSubstr("nq_registry_test_default_total 1\n"));
}

TEST(RegistryTest, AcceptsEveryValidNameCharacter) {
  Registry registry;
  registry.Gauge("_:aZ09", "Odd but legal.", {"_aZ09", "_"});
  EXPECT_THAT(registry.Serialize(), HasSubstr("# TYPE _:aZ09 gauge\n"));
}

}  // namespace
}  // namespace nq::metrics
