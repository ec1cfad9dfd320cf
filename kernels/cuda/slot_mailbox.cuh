// Backend::ApplySlotMailbox on the GPU (kernels/slot_mailbox.h has the protocol and the host
// oracle): a thread per expert of the layer. The row lives in host memory mapped into the
// device, so each thread's loads cross PCIe once per step (about a microsecond, all experts in
// parallel); only a moved row costs a second load and a store back to the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/slot_mailbox.h"

namespace nq::kernels::cuda {

// applied: [experts] packed entries in device memory; slot_of_expert: [experts] in device memory.
absl::Status LaunchApplySlotMailbox(const SlotMailboxRow& row, std::uint64_t* applied, std::int32_t* slot_of_expert,
                                    const LaunchContext& ctx);

}  // namespace nq::kernels::cuda
