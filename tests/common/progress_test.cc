#include "services/common/progress.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace nq {
namespace {

using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

TEST(ProgressTest, QuantitiesAndDurationsReadAsPeopleWriteThem) {
  EXPECT_EQ(HumanQuantity(999, "B"), "999 B");
  EXPECT_EQ(HumanQuantity(1234567, "B"), "1.23 MB");
  EXPECT_EQ(HumanQuantity(2.5e9, "weights"), "2.50 G weights");
  EXPECT_EQ(HumanQuantity(7e15, "B"), "7000.00 TB");
  EXPECT_EQ(HumanDuration(absl::Seconds(12.4)), "12s");
  EXPECT_EQ(HumanDuration(absl::Seconds(391)), "6m31s");
  EXPECT_EQ(HumanDuration(absl::Seconds(4000)), "1h06m");
  EXPECT_EQ(HumanDuration(absl::Seconds(-3)), "0s");
}

TEST(ProgressTest, ALineSaysWhatIsDoneWhereTheRateAndWhatIsLeft) {
  const ProgressState state{.done = 25, .total = 100, .work = 5e9, .stage = "layer 3 rank 1"};
  EXPECT_EQ(FormatProgress(state, "experts", "weights", absl::Seconds(100)),
            "25/100 experts (25.0%), layer 3 rank 1; 5.00 G weights at 50.00 M weights/s; 1m40s elapsed, ~5m00s left");
}

// A resumed job skips units already on disk at once: they must not make the rest look fast.
TEST(ProgressTest, SkippedUnitsDoNotShortenTheEstimate) {
  const ProgressState resumed{.done = 60, .total = 100, .skipped = 50, .work = 1e6};
  // 10 units took 100 s: 40 more take 400 s, not the 67 s that 60 done would suggest.
  EXPECT_THAT(FormatProgress(resumed, "experts", "B", absl::Seconds(100)), EndsWith("~6m40s left"));
  const ProgressState only_skipped{.done = 50, .total = 100, .skipped = 50};
  EXPECT_THAT(FormatProgress(only_skipped, "experts", "B", absl::Seconds(1)), Not(HasSubstr("left")));
  EXPECT_THAT(FormatProgress(only_skipped, "experts", "B", absl::Seconds(1)), Not(HasSubstr(" at ")));
}

TEST(ProgressTest, TheEndSaysDoneAndAnEmptyJobIsComplete) {
  EXPECT_THAT(FormatProgress({.done = 8, .total = 8, .work = 4096}, "files", "B", absl::Seconds(2)),
              EndsWith("2s elapsed, done"));
  EXPECT_THAT(FormatProgress({.done = 0, .total = 0}, "files", "B", absl::Seconds(0)), StartsWith("0/0 files (100.0%)"));
}

class FakeClock {
 public:
  absl::Time Now() const { return now_; }
  void Advance(absl::Duration d) { now_ += d; }

 private:
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

// In a log: the first report, then at most one line per interval, and always the last.
TEST(ProgressTest, PlainLinesComeAtTheStartEveryIntervalAndAtTheEnd) {
  FakeClock clock;
  std::vector<std::string> lines;
  ProgressReporter reporter({.task = "encode",
                             .unit = "experts",
                             .line_interval = absl::Seconds(30),
                             .write = [&](std::string_view text) { lines.emplace_back(text); },
                             .clock = [&] { return clock.Now(); }});
  for (int done = 1; done <= 10; ++done) {
    clock.Advance(absl::Seconds(10));
    reporter.Update({.done = done, .total = 10, .work = 1000.0 * done});
  }
  reporter.Finish();  // the last line was printed already: not again
  // Reports at 10, 20, ..., 100 s: printed at 10 (first), 40, 70, 100 (last).
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_THAT(lines[0], StartsWith("nq encode: 1/10 experts (10.0%)"));
  EXPECT_THAT(lines[1], StartsWith("nq encode: 4/10 experts"));
  EXPECT_THAT(lines[2], StartsWith("nq encode: 7/10 experts"));
  EXPECT_EQ(lines[3], "nq encode: 10/10 experts (100.0%); 10.00 kB at 100 B/s; 1m40s elapsed, done\n");
  for (const std::string& line : lines) EXPECT_THAT(line, EndsWith("\n"));
}

// On a terminal: one line redrawn in place, a newline only at the end; Finish ends a job that
// stopped short with its last state.
TEST(ProgressTest, ATerminalLineIsRedrawnInPlaceAndFinishEndsIt) {
  FakeClock clock;
  std::vector<std::string> writes;
  ProgressReporter reporter({.task = "verify",
                             .unit = "files",
                             .terminal = true,
                             .redraw_interval = absl::Milliseconds(200),
                             .write = [&](std::string_view text) { writes.emplace_back(text); },
                             .clock = [&] { return clock.Now(); }});
  reporter.Update({.done = 1, .total = 5});
  clock.Advance(absl::Milliseconds(50));
  reporter.Update({.done = 2, .total = 5});  // too soon: not drawn
  clock.Advance(absl::Milliseconds(200));
  reporter.Update({.done = 3, .total = 5});
  reporter.Finish();
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_THAT(writes[0], StartsWith("\r\033[Knq verify: 1/5 files"));
  EXPECT_THAT(writes[0], Not(EndsWith("\n")));
  EXPECT_THAT(writes[1], StartsWith("\r\033[Knq verify: 3/5 files"));
  EXPECT_THAT(writes[2], StartsWith("\r\033[Knq verify: 3/5 files"));
  EXPECT_THAT(writes[2], EndsWith("\n"));
}

TEST(ProgressTest, FinishWithoutAReportPrintsNothing) {
  std::vector<std::string> lines;
  ProgressReporter reporter({.task = "assemble", .unit = "installs", .write = [&](std::string_view t) { lines.emplace_back(t); }});
  reporter.Finish();
  EXPECT_TRUE(lines.empty());
}

}  // namespace
}  // namespace nq
