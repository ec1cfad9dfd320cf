#include "services/common/slot_mailbox.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq {
namespace {

constexpr uint32_t kMagic = 0x584d514e;  // "NQMX"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 64;

struct Header {
  uint32_t magic;
  uint32_t version;
  uint32_t layers;
  uint32_t experts;
};

uint64_t Entries(uint32_t layers, uint32_t experts) { return static_cast<uint64_t>(layers) * experts; }
// staged and seq take 4 bytes an entry each; published starts 8-byte aligned after them.
uint64_t PublishedOffset(uint64_t entries) { return kHeaderBytes + (8 * entries + 7) / 8 * 8; }

template <typename T>
std::atomic_ref<T> Atomic(T& value) {
  return std::atomic_ref<T>(value);
}

}  // namespace

uint64_t SlotMailbox::BytesFor(uint32_t layers, uint32_t experts) {
  const uint64_t entries = Entries(layers, experts);
  return PublishedOffset(entries) + 8 * entries;
}

SlotMailbox::SlotMailbox(SharedMemory memory, uint32_t layers, uint32_t experts)
    : memory_(std::move(memory)), layers_(layers), experts_(experts) {}

absl::StatusOr<SlotMailbox> SlotMailbox::Create(const std::string& name, uint32_t layers, uint32_t experts) {
  if (layers == 0 || experts == 0) {
    return absl::InvalidArgumentError(absl::StrCat("a slot mailbox of ", layers, " layers x ", experts, " experts"));
  }
  ASSIGN_OR_RETURN(SharedMemory memory, SharedMemory::Create(name, BytesFor(layers, experts)));
  SlotMailbox mailbox(std::move(memory), layers, experts);
  const Header header{.magic = kMagic, .version = kVersion, .layers = layers, .experts = experts};
  std::memcpy(mailbox.memory_.data(), &header, sizeof(header));
  const uint64_t entries = Entries(layers, experts);
  for (uint64_t i = 0; i < entries; ++i) {
    mailbox.staged()[i] = -1;
    mailbox.published()[i] = kernels::kMailboxEmptyEntry;
  }
  return mailbox;
}

absl::StatusOr<SlotMailbox> SlotMailbox::Open(const std::string& name, uint32_t layers, uint32_t experts) {
  if (layers == 0 || experts == 0) {
    return absl::InvalidArgumentError(absl::StrCat("a slot mailbox of ", layers, " layers x ", experts, " experts"));
  }
  ASSIGN_OR_RETURN(SharedMemory memory, SharedMemory::Open(name, BytesFor(layers, experts)));
  Header header;
  std::memcpy(&header, memory.data(), sizeof(header));
  if (header.magic != kMagic || header.version != kVersion || header.layers != layers || header.experts != experts) {
    return absl::FailedPreconditionError(absl::StrCat(
        "slot mailbox ", name, " holds magic ", header.magic, " version ", header.version, " for ", header.layers,
        " layers x ", header.experts, " experts; expected magic ", kMagic, " version ", kVersion, " for ", layers,
        " x ", experts));
  }
  return SlotMailbox(std::move(memory), layers, experts);
}

int32_t* SlotMailbox::staged() const { return reinterpret_cast<int32_t*>(memory_.data() + kHeaderBytes); }
uint32_t* SlotMailbox::seq() const {
  return reinterpret_cast<uint32_t*>(memory_.data() + kHeaderBytes + 4 * Entries(layers_, experts_));
}
uint64_t* SlotMailbox::published() const {
  return reinterpret_cast<uint64_t*>(memory_.data() + PublishedOffset(Entries(layers_, experts_)));
}

kernels::SlotMailboxRow SlotMailbox::Row(size_t layer, std::byte* alias) const {
  const size_t first = Index(layer, 0);
  auto rebase = [&](auto* p) {
    if (alias == nullptr) return p;
    const std::ptrdiff_t offset = reinterpret_cast<std::byte*>(p) - data();
    return reinterpret_cast<decltype(p)>(alias + offset);
  };
  return {.staged = rebase(staged() + first),
          .seq = rebase(seq() + first),
          .published = rebase(published() + first),
          .experts = static_cast<int32_t>(experts_)};
}

kernels::SlotMailboxRow SlotMailbox::AllRows(std::byte* alias) const {
  kernels::SlotMailboxRow row = Row(0, alias);
  row.experts = static_cast<int32_t>(Entries(layers_, experts_));
  return row;
}

absl::StatusOr<uint32_t> SlotMailbox::Post(size_t layer, uint32_t expert, int32_t slot) {
  if (layer >= layers_ || expert >= experts_) {
    return absl::OutOfRangeError(absl::StrCat("slot mailbox ", name(), ": layer index ", layer, " expert ", expert,
                                              " outside its ", layers_, " x ", experts_));
  }
  const size_t i = Index(layer, expert);
  // Release: a reader that takes this row (even beside an older seq, when posts of one expert
  // overlap its two loads) sees the slot bytes written before this call.
  Atomic(staged()[i]).store(slot, std::memory_order_release);
  const uint32_t next = Atomic(seq()[i]).load(std::memory_order_relaxed) + 1;
  // Release: a reader that sees `next` sees the row, and the slot bytes written before this call.
  Atomic(seq()[i]).store(next, std::memory_order_release);
  return next;
}

uint32_t SlotMailbox::PostedSeq(size_t layer, uint32_t expert) const {
  return Atomic(seq()[Index(layer, expert)]).load(std::memory_order_acquire);
}

uint64_t SlotMailbox::Published(size_t layer, uint32_t expert) const {
  return Atomic(published()[Index(layer, expert)]).load(std::memory_order_acquire);
}

size_t SlotMailbox::ApplyOnHost() {
  size_t taken = 0;
  const uint64_t entries = Entries(layers_, experts_);
  for (uint64_t i = 0; i < entries; ++i) {
    const uint32_t posted = Atomic(seq()[i]).load(std::memory_order_acquire);
    if (posted == kernels::MailboxEntrySeq(Atomic(published()[i]).load(std::memory_order_relaxed))) continue;
    const int32_t slot = Atomic(staged()[i]).load(std::memory_order_acquire);
    Atomic(published()[i]).store(kernels::PackMailboxEntry(posted, slot), std::memory_order_release);
    ++taken;
  }
  return taken;
}

}  // namespace nq
