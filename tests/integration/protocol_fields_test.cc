// Protocol fields the services promise (issue 24): ModelInfo.release_id names the release the
// experts come from, and a worker asked for MTP drafts it cannot make refuses instead of
// ignoring the field.
#include <cstdio>
#include <string>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "nq/v1/inference.grpc.pb.h"
#include "nq/v1/worker.grpc.pb.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;

// sha256 of a file by the system's sha256sum: an id computed without our release reader.
std::string Sha256Sum(const std::string& path) {
  const std::string command = "sha256sum '" + path + "'";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  char hex[65] = {};
  const size_t n = std::fread(hex, 1, 64, pipe);
  pclose(pipe);
  return std::string(hex, n);
}

absl::StatusOr<nq::v1::ModelInfo> RouterModelInfo(int grpc_port) {
  auto stub = nq::v1::Inference::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", grpc_port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  nq::v1::ModelInfo info;
  grpc::Status status = stub->GetModelInfo(&context, nq::v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return info;
}

TEST_F(ServingTest, ModelInfoNamesTheReleaseTheExpertsComeFrom) {
  StartCluster({}, /*streamed=*/true);
  const std::string expected = Sha256Sum(*model_dir_ + "/release/manifest.json");
  ASSERT_EQ(expected.size(), 64u);
  absl::StatusOr<nq::v1::ModelInfo> info = RouterModelInfo(router_ports_.grpc);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->release_id(), expected);
  // The streamer serves the same release, by its own reading of the records.
  EXPECT_THAT(streamer_->Log(), HasSubstr("release " + expected));
  EXPECT_EQ(info->num_speculative_tokens(), 0u);
}

TEST_F(ServingTest, ModelInfoHasNoReleaseForCheckpointExperts) {
  StartCluster();
  absl::StatusOr<nq::v1::ModelInfo> info = RouterModelInfo(router_ports_.grpc);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->release_id(), "");
  EXPECT_EQ(info->architecture(), "GlmMoeDsaForCausalLM");
}

TEST_F(ServingTest, AWorkerAskedForMtpDraftsRefusesByName) {
  StartCluster();
  auto stub = nq::v1::Worker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", worker_ports_.grpc), grpc::InsecureChannelCredentials()));
  auto generate = [&](std::optional<uint32_t> drafts) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    nq::v1::WorkerGenerateRequest request;
    request.set_request_id("mtp");
    request.add_prompt_token_ids(1);
    request.mutable_sampling()->set_max_tokens(2);
    request.mutable_sampling()->set_ignore_eos(true);
    if (drafts.has_value()) request.set_num_speculative_tokens(*drafts);
    auto reader = stub->Generate(&context, request);
    nq::v1::WorkerGenerateResponse response;
    int tokens = 0;
    while (reader->Read(&response)) tokens += response.tokens_size();
    return std::make_pair(reader->Finish(), tokens);
  };
  const auto [refused, none] = generate(3);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("num_speculative_tokens 3"));
  EXPECT_EQ(none, 0);
  // 0 and unset decode as before.
  for (std::optional<uint32_t> drafts : {std::optional<uint32_t>(0), std::optional<uint32_t>()}) {
    const auto [status, tokens] = generate(drafts);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(tokens, 2);
  }
}

}  // namespace
}  // namespace nq::testing
