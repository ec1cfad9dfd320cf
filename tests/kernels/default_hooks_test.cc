// The default model-op hooks of Backend: a backend that does not implement an op yet answers
// UnimplementedError naming the op and itself, after the shared validation has passed.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::StatusIs;
using ::testing::HasSubstr;

class HostStorage final : public Storage {
 public:
  explicit HostStorage(std::size_t bytes)
      : Storage(std::calloc(bytes == 0 ? 1 : bytes, 1), bytes) {}
  ~HostStorage() override { std::free(data()); }
};

// Memory and copies only: every op hook is left at Backend's default or fails loudly.
class BareBackend final : public Backend {
 public:
  std::string_view name() const override { return "bare"; }
  std::string DeviceDescription() const override { return "bare host memory"; }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 protected:
  absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) override {
    return std::make_unique<HostStorage>(bytes);
  }
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoMatMul(const Tensor&, const Tensor&, Tensor&, const MatMulDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoMatMulBlockScaled(const Tensor&, const Tensor&, const Tensor&, Tensor&,
                                   const MatMulDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoRmsNorm(const Tensor&, const Tensor&, float, Tensor&, const RowDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoSiluAndMul(const Tensor&, Tensor&, const RowDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoSoftmax(const Tensor&, float, Tensor&, const RowDims&) override {
    return absl::InternalError("unused");
  }
};

class DefaultHooks : public ::testing::Test {
 protected:
  Tensor F32(Shape shape) { return *backend_.Allocate(DType::kF32, std::move(shape)); }
  static auto Unimplemented(const std::string& op) {
    return StatusIs(absl::StatusCode::kUnimplemented,
                    HasSubstr(op + " is not implemented by the bare backend"));
  }

  BareBackend backend_;
};

TEST_F(DefaultHooks, EveryModelOpIsUnimplementedAfterValidation) {
  Tensor a = F32({2, 4});
  Tensor b = F32({2, 4});
  Tensor w = F32({4});
  Tensor cache = F32({6, 4});
  const std::vector<std::int32_t> rows = {1, 0};
  EXPECT_THAT(backend_.Embedding(rows, a, b), Unimplemented("Embedding"));
  EXPECT_THAT(backend_.Add(a, a, b), Unimplemented("Add"));
  Tensor x = F32({2, 1, 4});
  EXPECT_THAT(backend_.Rope(x, 0, std::vector<float>{1.0f, 0.5f}, 1.0f, true),
              Unimplemented("Rope"));
  EXPECT_THAT(backend_.LayerNorm(a, w, w, 1e-5f, b), Unimplemented("LayerNorm"));
  EXPECT_THAT(backend_.WriteRows(a, cache, 1), Unimplemented("WriteRows"));
  EXPECT_THAT(backend_.GatherRows(a, rows, b), Unimplemented("GatherRows"));
  EXPECT_THAT(backend_.ScatterAddRows(a, rows, std::vector<float>{1.0f, 1.0f}, b),
              Unimplemented("ScatterAddRows"));
  // T = 2, H = 1, dn = 4, dr = 4, c = 4, dv = 4, S = 6.
  Tensor w3 = F32({1, 4, 4});
  Tensor w3v = F32({1, 4, 4});
  EXPECT_THAT(backend_.MlaAttention(x, x, cache, cache, w3, w3v, nullptr, 0, 0.5f, b),
              Unimplemented("MlaAttention"));
  Tensor selected = *backend_.Allocate(DType::kI32, {2, 3});
  Tensor weights = F32({2, 1});
  EXPECT_THAT(backend_.IndexerTopK(x, cache, weights, 0, selected), Unimplemented("IndexerTopK"));
}

TEST_F(DefaultHooks, ValidationStillRunsFirst) {
  Tensor a = F32({2, 4});
  Tensor b = F32({3, 4});
  EXPECT_THAT(backend_.Add(a, a, b),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Add: out is F32[3, 4]")));
}

}  // namespace
}  // namespace nq::kernels
