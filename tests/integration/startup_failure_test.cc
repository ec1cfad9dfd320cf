// A service that cannot start says why and exits non-zero.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/integration/cluster_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;

// Holds a listening socket on a loopback port for the test's lifetime.
class PortHolder {
 public:
  PortHolder() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 1), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~PortHolder() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A service that cannot start (ClusterTest::ExpectStartupFailure).
class StartupFailureTest : public ClusterTest {};

TEST_F(StartupFailureTest, GrpcPortInUse) {
  PortHolder held;
  const std::string log = ExpectStartupFailure(StartStreamer(ServicePorts{held.port(), FreePort()}));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("cannot listen for gRPC on 127.0.0.1:", held.port())));
}

TEST_F(StartupFailureTest, HttpPortInUse) {
  PortHolder held;
  const std::string log = ExpectStartupFailure(StartRouter(ServicePorts{FreePort(), held.port()}, FreePort()));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("cannot listen for HTTP on 127.0.0.1:", held.port())));
}

TEST_F(StartupFailureTest, MetricsPortInUse) {
  PortHolder held;
  const std::string log = ExpectStartupFailure(StartWorker(ServicePorts{FreePort(), held.port()}, FreePort()));
  EXPECT_THAT(log, HasSubstr("in use"));
}

TEST_F(StartupFailureTest, BadFlagValues) {
  const ServicePorts ports = NewPorts();
  struct Case {
    std::string which;
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"router", {"--http_port=eighty"}, "http_port"},
      {"router", {"--worker_address=nohostport"}, "--worker_address=nohostport"},
      {"router", {"--drain_timeout_s=-1"}, "--drain_timeout_s"},
      {"streamer", {"--grpc_port=70000"}, "--grpc_port=70000"},
      {"streamer", {"--records_dir=/nonexistent/records"}, "not a directory"},
      // One --log_level for every service (services/common/service_main.cc).
      {"router", {"--log_level=loud"}, "--log_level"},
      {"streamer", {"--log_level=loud"}, "--log_level"},
      {"worker", {"--log_level=loud"}, "--log_level"},
      {"worker", {"--rank=2", "--world_size=2"}, "0 <= rank < world_size"},
      // A node's rank past its node's share, and a node's ranks beyond the world size.
      {"worker", {"--node_rank=1", "--ranks_per_node=2", "--rank=2", "--world_size=4"}, "want the rank within the node, 0..1"},
      {"worker", {"--node_rank=2", "--ranks_per_node=2", "--rank=1", "--world_size=4"}, "--rank=5 --world_size=4"},
      {"worker", {"--rank=1", "--world_size=2", "--tp_control=udp"}, "--tp_control=udp: want shm or tcp"},
      {"worker", {"--rank=1", "--world_size=2", "--tp_control=tcp", "--leader_address=10.1.2.3:8100"},
       "--tp_control=tcp on 10.1.2.3 (beyond loopback) is not encrypted"},
      {"streamer", {"--decider_address=127.0.0.1:8200"}, "--decider_address needs --records_dir"},
      {"streamer", {"--decider_address=nohostport"}, "--decider_address=nohostport"},
      {"worker", {"--backend=tpu"}, "tpu"},
      {"worker", {"--gpu=-1"}, "--gpu must be a device ordinal"},
      {"worker", {"--decode_gemv=fast"}, "--decode_gemv: decode GEMV 'fast' (expected auto, tensor or fma)"},
      // The decode GEMV is the CUDA backend's: the CPU refuses to be told one.
      {"worker", {"--decode_gemv=tensor"}, "applies to the cuda backend"},
      // Not compiled in (the CPU preset), or no usable device: refused either way, by name.
      {"worker", {"--backend=cuda"}, "cuda"},
      {"worker", {"--rec_bytes=1000"}, "multiple of 4096"},
      {"worker", {"--slots_per_layer=0"}, "must be positive"},
      {"worker", {"--no_such_flag=1"}, "no_such_flag"},
      {"streamer", {"--read_queue_depth=0"}, "--read_queue_depth"},
      {"streamer", {"--direct_io=maybe"}, "--direct_io=maybe"},
      {"streamer", {"--record_check=md5"}, "--record_check must be fastest or sha256, not 'md5'"},
      {"streamer", {"--record_mirrors=" + log_dir_}, "--record_mirrors needs --records_dir"},
      // A directory that holds no release: refused at start, not at the first session.
      {"streamer", {"--records_dir=" + log_dir_}, "COMPLETE"},
      {"worker", {"--expert_bits=3"}, "--expert_bits=3"},
      {"worker", {"--slot_wait_tokens=-1"}, "must not be negative"},
      {"worker", {"--release=" + log_dir_}, "--release needs --model"},
      {"worker", {"--kv_cache_dtype=fp16"}, "--kv_cache_dtype=fp16: want f32, bf16 or fp8"},
      {"worker", {"--weight_dtype=fp4"}, "--weight_dtype=fp4: want f32, bf16 or fp8"},
      {"streamer", {"--read_piece_kib=3"}, "--read_piece_kib=3"},
      {"worker", {"--kv_cache_dtype=bf16"}, "--kv_cache_dtype=bf16 needs --model"},
      {"worker", {"--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny", "--release=" + log_dir_}, "COMPLETE"},
      {"worker", {"--prefill_chunk_tokens=0"}, "--prefill_chunk_tokens=0"},
      {"worker", {"--layer_major_prefill_tokens=-5"}, "--layer_major_prefill_tokens=-5"},
      {"worker", {"--prefill_expert_slots=-2"}, "--prefill_expert_slots=-2"},
      {"worker", {"--prefill_full_span_tokens=0"}, "--prefill_full_span_tokens=0"},
      // Gate lookahead: a negative depth; a group, whose slot changes wait for the step's end; no
      // model to predict with; a depth no MoE layer is that far ahead for (glm5_tiny's layers).
      {"worker", {"--lookahead_layers=-1"}, "--lookahead_layers=-1 is negative"},
      {"worker", {"--lookahead_layers=1", "--world_size=2", "--rank=1"}, "--lookahead_layers=1 with --world_size > 1"},
      {"worker", {"--lookahead_layers=1"}, "--lookahead_layers=1 needs --model"},
      {"worker", {"--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny", "--lookahead_layers=64"},
       "--lookahead_layers=64: the model has no MoE layer 64 layers after another"},
      {"worker", {"--prefill_late_read_share=2"}, "--prefill_late_read_share=2: want a share"},
      {"worker", {"--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny", "--max_model_len=lots"},
       "--max_model_len must be a positive number of tokens or auto, got 'lots'"},
      {"worker", {"--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny", "--max_model_len=0"},
       "--max_model_len must be a positive number of tokens or auto"},
      {"worker",
       {"--model=" NQ_SOURCE_DIR "/tests/fixtures/models/glm5_tiny", "--max_model_len=auto", "--world_size=2",
        "--rank=1"},
       "--max_model_len=auto sizes one rank's cache"},
  };
  for (const Case& c : cases) {
    ChildProcess child = c.which == "router"     ? StartRouter(ports, FreePort(), c.args)
                         : c.which == "streamer" ? StartStreamer(ports, c.args)
                                                 : StartWorker(ports, FreePort(), c.args);
    EXPECT_THAT(ExpectStartupFailure(std::move(child)), HasSubstr(c.message)) << c.which << " " << c.args[0];
  }
}

}  // namespace
}  // namespace nq::testing
