// nq encode / synth-release --device: where trellis_v1's tiles are searched. A bad value is
// refused by name before any checkpoint is read; cuda in a build without CUDA says so; cpu
// searches on every core and says where.
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/run_shell.h"

namespace nq::release {
namespace {

using ::nq::testing::CommandResult;
using ::nq::testing::RunShell;
using ::testing::HasSubstr;

CommandResult RunNq(const std::string& args) { return RunShell(absl::StrCat(NQ_TOOL_BIN, " ", args)); }

class EncodeDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           absl::StrCat("encode_device_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "model");
    std::filesystem::copy_file(std::filesystem::path(NQ_SOURCE_DIR) / "configs/test/glm5_encode.json",
                               dir_ / "model/config.json");
  }
  std::string Model() const { return (dir_ / "model").string(); }
  std::string Out() const { return (dir_ / "release").string(); }

  std::filesystem::path dir_;
};

TEST_F(EncodeDeviceTest, AnUnknownDeviceIsRefusedByName) {
  for (const char* device : {"gpu", "cuda:x", "cuda:", "CPU", "cuda:0,0", "cuda:1,", "cuda:-1"}) {
    SCOPED_TRACE(device);
    const CommandResult r = RunNq(absl::StrCat("encode --model=", Model(), " --out=", Out(), " --codec=trellis --device=", device));
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr(absl::StrCat("--device: expected cpu, cuda or cuda:N[,M...] (distinct GPUs), got '",
                                                 device, "'")));
  }
  EXPECT_FALSE(std::filesystem::exists(Out()));
  // bench-codec takes the same flag, and refuses before its CPU measurements.
  const CommandResult bench = RunNq("bench-codec --size=128 --codecs=scalar --device=tpu");
  EXPECT_NE(bench.exit_code, 0) << bench.output;
  EXPECT_THAT(bench.output, HasSubstr("got 'tpu'"));
  EXPECT_THAT(bench.output, ::testing::Not(HasSubstr("MSE on")));
}

TEST_F(EncodeDeviceTest, NegativeWorkersAreRefused) {
  const CommandResult r = RunNq(absl::StrCat("encode --model=", Model(), " --out=", Out(), " --workers=-2"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--workers must be >= 0"));
  EXPECT_FALSE(std::filesystem::exists(Out()));
}

TEST_F(EncodeDeviceTest, AnUnknownBaseGridIsRefusedAndLloydIsRecorded) {
  const CommandResult bad = RunNq(absl::StrCat("encode --model=", Model(), " --out=", Out(), " --base_levels=even"));
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("--base_levels must be uniform, lloyd or uniform_nested, got 'even'"));
  EXPECT_FALSE(std::filesystem::exists(Out()));
  const CommandResult lloyd = RunNq(absl::StrCat("synth-release --model=", Model(), " --out=", Out(), " --base_levels=lloyd"));
  ASSERT_EQ(lloyd.exit_code, 0) << lloyd.output;
  const CommandResult manifest = RunShell(absl::StrCat("cat ", Out(), "/manifest.json"));
  EXPECT_THAT(manifest.output, HasSubstr("\"base_grid\": \"lloyd\""));
}

TEST_F(EncodeDeviceTest, CudaIsRefusedWhereItCannotRun) {
  const CommandResult r = RunNq(absl::StrCat("synth-release --model=", Model(), " --out=", Out(), " --codec=trellis --device=cuda"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  const CommandResult several = RunNq(absl::StrCat("encode --model=", Model(), " --out=", Out(), " --device=cuda:0,1"));
  EXPECT_NE(several.exit_code, 0) << several.output;
#if !NQ_HAVE_CUDA
  EXPECT_THAT(r.output, HasSubstr("this nq was built without CUDA"));
#endif
  EXPECT_FALSE(std::filesystem::exists(Out()));
}

TEST_F(EncodeDeviceTest, TheCpuSearchRunsOnEveryCoreAndTheReleaseVerifies) {
  const CommandResult r = RunNq(absl::StrCat("synth-release --model=", Model(), " --out=", Out(), " --codec=trellis --device=cpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("trellis tiles searched on cpu, "));
  const CommandResult verify = RunNq(absl::StrCat("verify ", Out()));
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

}  // namespace
}  // namespace nq::release
