// Issue #22: a worker's slot arena (POSIX shared memory) is its user's alone (0600) and leaves
// no name behind on any way out: a drained SIGTERM unlinks it here; a SIGKILL, which runs no
// code, is covered by the streamer unlinking a dead worker's arena (serving_test.cc,
// AWorkerKilledMidGenerationReleasesItsArena).
#include <sys/stat.h>

#include <csignal>
#include <filesystem>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

TEST_F(ServingTest, AWorkerStoppedWithSigtermUnlinksItsOwnerOnlyArena) {
  StartCluster({}, /*streamed=*/true);
  // "arena shm /nq-arena-r0-... (N bytes)"
  constexpr std::string_view kPrefix = "arena shm ";
  const std::string log = worker_->Log();
  const size_t at = log.find(std::string(kPrefix) + "/nq-arena-");
  ASSERT_NE(at, std::string::npos) << log;
  const size_t name_at = at + kPrefix.size();
  const std::string path = "/dev/shm" + log.substr(name_at, log.find(' ', name_at) - name_at);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  EXPECT_EQ(st.st_mode & 0777, 0600u) << path;

  worker_->Signal(SIGTERM);
  absl::StatusOr<int> code = worker_->WaitForExit(std::chrono::seconds(20));
  ASSERT_TRUE(code.ok() && *code == 0) << worker_->Log();
  worker_.reset();
  EXPECT_FALSE(std::filesystem::exists(path)) << "the drained worker left its arena behind";
}

}  // namespace
}  // namespace nq::testing
