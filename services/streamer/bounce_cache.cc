#include "services/streamer/bounce_cache.h"

#include <spdlog/spdlog.h>

namespace nq::streamer {

BounceCache::BounceCache(std::span<const unsigned> buffers) {
  entries_.reserve(buffers.size());
  for (unsigned b : buffers) {
    Entry entry;
    entry.buffer = b;
    entries_.push_back(entry);
  }
}

std::optional<unsigned> BounceCache::Lookup(const RecordKey& key) {
  for (Entry& e : entries_) {
    if (!e.busy && e.holds_record && e.key == key) {
      e.last_use = ++clock_;
      return e.buffer;
    }
  }
  return std::nullopt;
}

bool BounceCache::Contains(const RecordKey& key) const {
  for (const Entry& e : entries_) {
    if (!e.busy && e.holds_record && e.key == key) return true;
  }
  return false;
}

std::optional<unsigned> BounceCache::AcquireForRead() {
  Entry* victim = nullptr;
  for (Entry& e : entries_) {
    if (!e.busy && (victim == nullptr || e.last_use < victim->last_use)) victim = &e;
  }
  if (victim == nullptr) return std::nullopt;
  victim->busy = true;
  victim->holds_record = false;
  return victim->buffer;
}

BounceCache::Entry* BounceCache::Find(unsigned buffer) {
  for (Entry& e : entries_) {
    if (e.buffer == buffer) return &e;
  }
  return nullptr;
}

void BounceCache::Fill(unsigned buffer, const RecordKey& key) {
  Entry* entry = Find(buffer);
  if (entry == nullptr || !entry->busy) {
    // The loader's bookkeeping is off; refusing to cache is always safe.
    spdlog::error("bounce cache: fill of buffer {} that is not being read into; not cached", buffer);
    if (entry != nullptr) Discard(buffer);
    return;
  }
  for (Entry& e : entries_) {
    if (&e != entry && e.holds_record && e.key == key) {
      e.holds_record = false;
      e.last_use = 0;
    }
  }
  entry->busy = false;
  entry->holds_record = true;
  entry->key = key;
  entry->last_use = ++clock_;
}

void BounceCache::Discard(unsigned buffer) {
  Entry* entry = Find(buffer);
  if (entry == nullptr) return;
  entry->busy = false;
  entry->holds_record = false;
  entry->last_use = 0;
}

size_t BounceCache::idle() const {
  size_t n = 0;
  for (const Entry& e : entries_) n += e.busy ? 0 : 1;
  return n;
}

size_t BounceCache::records() const {
  size_t n = 0;
  for (const Entry& e : entries_) n += (!e.busy && e.holds_record) ? 1 : 0;
  return n;
}

}  // namespace nq::streamer
