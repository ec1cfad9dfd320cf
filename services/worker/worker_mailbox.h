// A worker's slot mailbox (DESIGN.md section 4, services/common/slot_mailbox.h): the shared object
// the streamer posts slot-table changes to, mapped into the GPU when the worker serves there, and
// each MoE layer's row as the model's apply op reads it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/slot_mailbox.h"
#include "services/common/slot_geometry.h"
#include "services/common/slot_mailbox.h"

namespace nq::worker {

class WorkerMailbox {
 public:
  // A new mailbox for the geometry's MoE layers, named for `rank` and this process. `gpu`: the
  // device that applies it (the rows then hold that device's aliases), or nullopt for the CPU
  // backend. UNIMPLEMENTED for a GPU in a build without CUDA; the errors of SlotMailbox::Create
  // and of mapping host memory into the device.
  static absl::StatusOr<std::unique_ptr<WorkerMailbox>> Create(const SlotGeometry& geometry, int rank,
                                                               std::optional<int> gpu);
  ~WorkerMailbox();
  WorkerMailbox(const WorkerMailbox&) = delete;
  WorkerMailbox& operator=(const WorkerMailbox&) = delete;

  SlotMailbox& mailbox() { return mailbox_; }
  const std::string& name() const { return mailbox_.name(); }
  // Model::SetSlotMailbox's arguments: every layer's entries as one row, and the MoE layer ids in
  // its order.
  const kernels::SlotMailboxRow& all_rows() const { return all_rows_; }
  const std::vector<int64_t>& layers() const { return layers_; }

 private:
  struct DeviceMapping;
  WorkerMailbox(SlotMailbox mailbox, std::unique_ptr<DeviceMapping> mapping, const SlotGeometry& geometry);

  SlotMailbox mailbox_;
  std::unique_ptr<DeviceMapping> mapping_;  // null on the CPU backend
  kernels::SlotMailboxRow all_rows_;
  std::vector<int64_t> layers_;
};

}  // namespace nq::worker
