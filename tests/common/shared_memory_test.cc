#include "services/common/shared_memory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/common/status_matchers.h"

namespace nq {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

std::string UniqueName(const char* tag) {
  return absl::StrCat("/nq-test-", tag, "-", getpid());
}

TEST(SharedMemoryTest, WritesAreVisibleThroughASecondMapping) {
  const std::string name = UniqueName("visible");
  absl::StatusOr<SharedMemory> owner = SharedMemory::Create(name, 8192);
  ASSERT_THAT(owner, IsOk());
  EXPECT_EQ(owner->data()[100], 0) << "a new object is zero-filled";
  absl::StatusOr<SharedMemory> reader = SharedMemory::Open(name, 8192);
  ASSERT_THAT(reader, IsOk());
  owner->data()[100] = 42;
  EXPECT_EQ(reader->data()[100], 42);
  EXPECT_FALSE(reader->owns_name());
}

TEST(SharedMemoryTest, CreatorUnlinksItsNameOnDestruction) {
  const std::string name = UniqueName("unlink");
  { ASSERT_THAT(SharedMemory::Create(name, 4096), IsOk()); }
  EXPECT_THAT(SharedMemory::Open(name, 4096), StatusIs(absl::StatusCode::kNotFound, HasSubstr(name)));
}

// Issue #22: an arena is readable and writable by its owner's user only, whatever the umask.
TEST(SharedMemoryTest, CreatedOwnerOnly) {
  const std::string name = UniqueName("mode");
  const mode_t old_umask = ::umask(0);  // the most permissive: only the mode asked for counts
  absl::StatusOr<SharedMemory> created = SharedMemory::Create(name, 4096);
  ::umask(old_umask);
  ASSERT_THAT(created, IsOk());
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &st), 0) << std::strerror(errno);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::getuid());
}

TEST(SharedMemoryTest, MovedFromObjectReleasesNothing) {
  const std::string name = UniqueName("move");
  absl::StatusOr<SharedMemory> created = SharedMemory::Create(name, 4096);
  ASSERT_THAT(created, IsOk());
  SharedMemory moved = std::move(*created);
  created = absl::UnknownError("drop the moved-from object");
  EXPECT_THAT(SharedMemory::Open(name, 4096), IsOk()) << "the name must survive the move";
}

TEST(SharedMemoryTest, RejectsBadInput) {
  const std::string name = UniqueName("bad");
  absl::StatusOr<SharedMemory> owner = SharedMemory::Create(name, 4096);
  ASSERT_THAT(owner, IsOk());
  EXPECT_THAT(SharedMemory::Create(name, 4096), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr(name)));
  EXPECT_THAT(SharedMemory::Open(name, 8192),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expected 8192")));
  EXPECT_THAT(SharedMemory::Create("no-slash", 4096), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'/'")));
  EXPECT_THAT(SharedMemory::Create("/a/b", 4096), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'/'")));
  EXPECT_THAT(SharedMemory::Create(UniqueName("zero"), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 bytes")));
}

TEST(SharedMemoryTest, UnlinkOfAMissingNameIsOk) {
  EXPECT_THAT(SharedMemory::Unlink(UniqueName("never-created")), IsOk());
}

}  // namespace
}  // namespace nq
