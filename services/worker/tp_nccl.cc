#include "services/worker/tp_nccl.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/comm/nccl_communicator.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

class NcclDataPlane final : public TpDataPlane {
 public:
  NcclDataPlane(std::unique_ptr<kernels::NcclCommunicator> comm, absl::Duration timeout)
      : comm_(std::move(comm)), timeout_(timeout) {}

  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->world_size(); }
  absl::Status AllReduceSum(kernels::Tensor& data) override { return comm_->AllReduceSum(data); }
  absl::Status Broadcast(kernels::Tensor& data, int root) override { return comm_->Broadcast(data, root); }
  // The logits' gather is a forward's last collective, and the model reads its result on the host
  // right after: waiting for it here, with the peers watched, turns a step a dead rank cut short
  // into an error instead of tokens sampled from whatever the buffers held.
  absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) override {
    RETURN_IF_ERROR(comm_->AllGather(in, out));
    return comm_->WaitForStream(timeout_);
  }
  // Graphed decode steps record the collectives (the all-gather's wait passes while capturing);
  // after each replay the model asks whether they all completed.
  bool CanCapture() const override { return true; }
  absl::Status CheckCompleted() override { return comm_->WaitForStream(timeout_); }
  absl::Status Health() override { return comm_->Health(); }
  void Abort(absl::string_view reason) override { comm_->Abort(reason); }

 private:
  std::unique_ptr<kernels::NcclCommunicator> comm_;
  const absl::Duration timeout_;
};

}  // namespace

absl::StatusOr<TpDataPlaneFactory> NcclDataPlaneFactory(int device, void* stream, absl::Duration collective_timeout) {
  if (stream == nullptr) {
    return absl::FailedPreconditionError("the NCCL data plane needs the CUDA backend's stream; this backend has none");
  }
  ASSIGN_OR_RETURN(const int version, kernels::NcclVersion());
  TpDataPlaneFactory factory;
  factory.transport = TpTransport::kNccl;
  factory.nccl_version = version;
  factory.new_id = [] { return kernels::NewNcclUniqueId(); };
  factory.join = [device, stream, collective_timeout](
                     const TpBootstrap& bootstrap, int rank,
                     const std::function<absl::Status()>& peers_alive) -> absl::StatusOr<std::unique_ptr<TpDataPlane>> {
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::NcclCommunicator> comm,
                     kernels::NcclCommunicator::Create(
                         bootstrap.id, kernels::NcclCommunicatorOptions{.rank = rank,
                                                                        .world_size = static_cast<int>(bootstrap.world_size),
                                                                        .device = device,
                                                                        .stream = stream,
                                                                        .join_timeout = collective_timeout,
                                                                        .peers_alive = peers_alive}));
    return std::make_unique<NcclDataPlane>(std::move(comm), collective_timeout);
  };
  return factory;
}

}  // namespace nq::worker
