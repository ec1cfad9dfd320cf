// The bounce buffers of one slot loader as an LRU cache of recent records (DESIGN.md section 4:
// "pinned bounce buffers that double as an LRU cache of recent records").
//
// A record read into a bounce buffer stays there after it is copied into a slot, until the
// buffer is taken for another read. When the predictor wants that expert again (it was
// evicted, then comes back), the loader copies it from the buffer into a slot without
// touching the disk.
//
// Each buffer is either busy (a read into it is outstanding) or idle; an idle buffer holds a
// record (key known) or nothing. Only the loader fills a buffer (Fill), and only with a read
// that landed whole and passed the store's checks: a failed, short or corrupt read is
// Discarded and never found by Lookup. A new read takes the least recently used idle buffer,
// empty ones first.
//
// Bookkeeping only: the bytes live in the RecordStore's registered buffers. Linear scans over
// the buffers (a few dozen per session; Lookup runs once per wanted load), no allocation after
// construction. Not thread-safe: the loader thread owns it.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace nq::streamer {

struct RecordKey {
  uint32_t rank = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
  auto operator<=>(const RecordKey&) const = default;
};

class BounceCache {
 public:
  // `buffers`: the RecordStore buffer indexes this cache hands out (those the arena could
  // prepare as copy sources). All start idle and empty.
  explicit BounceCache(std::span<const unsigned> buffers);

  // An idle buffer holding `key`'s record, now the most recently used; nullopt otherwise.
  std::optional<unsigned> Lookup(const RecordKey& key);
  // Whether Lookup would find `key` (does not touch the LRU order).
  bool Contains(const RecordKey& key) const;
  // Takes the least recently used idle buffer for a read (empty buffers first): it is busy
  // and its old record forgotten from now on. nullopt when every buffer is busy.
  std::optional<unsigned> AcquireForRead();
  // The read into busy `buffer` landed whole and checked: it now holds `key`'s record, idle,
  // most recently used. A record of `key` held by another buffer is forgotten (one copy).
  void Fill(unsigned buffer, const RecordKey& key);
  // The read into busy `buffer` failed, was cancelled or is not to be kept: idle and empty,
  // the first to be reused.
  void Discard(unsigned buffer);

  size_t size() const { return entries_.size(); }
  size_t idle() const;
  // Idle buffers holding a record.
  size_t records() const;

 private:
  struct Entry {
    unsigned buffer = 0;
    bool busy = false;
    bool holds_record = false;
    RecordKey key;
    uint64_t last_use = 0;  // 0: empty, reused first
  };
  Entry* Find(unsigned buffer);

  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

}  // namespace nq::streamer
