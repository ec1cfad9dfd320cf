// DSA indexer top-k selection by radix select (contract in kernels/backend.h): one block per
// query picks the top_k of its visible scores without sorting them, and writes them in key
// order.
//
// Scores map to order-preserving uint32 bits u (OrderedBits; NaN was already written as -inf and
// -0 as +0 by the scoring kernel). The selection order is (u descending, key ascending).
//  1. Digit passes over the score row (bits 31..21, 20..10, 9..0): a shared-memory histogram of
//     the next digit among the keys whose higher digits match the prefix found so far; the
//     threshold digit is the one where the count above it first reaches the keys still needed.
//     Stop as soon as the threshold bucket fits the candidate buffer (usually after the first).
//  2. One ordered pass over the row: keys above the prefix go to the output buffer; keys in the
//     threshold bucket are compacted, in key order, into the candidate buffer (or, when all 32
//     bits are resolved, the first `needed` of those ties go straight to the output).
//  3. The remaining digit passes and the final ordered pass run over the candidates in shared
//     memory. Ties at the threshold value are taken in key order (block scans), so lower keys
//     win.
//  4. The min(top_k, visible) survivors' keys in ascending key order (WriteKeysAscending: a
//     bitmap and a block scan, no sort), and -1 past the visible ones.
// The row is read twice in the usual case; a degenerate row (most keys in one bucket, e.g. all
// scores equal) takes up to three histogram passes and one ordered pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/indexer_topk.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

inline constexpr int kSelectThreads = 1024;
inline constexpr int kSelectWarps = kSelectThreads / kWarpSize;
inline constexpr int kRadixBits = 11;
inline constexpr int kRadixBins = 1 << kRadixBits;
inline constexpr int kSelectItems = 4;  // consecutive keys per thread in an ordered pass
static_assert(kRadixBins == 2 * kSelectThreads, "DigitPass gives each thread two bins");
static_assert(kSelectWarps == kWarpSize, "BlockExclusiveSum scans the warp sums in one warp");

// The first (top) digit: bits 31..21 of OrderedBits.
inline constexpr int kTopDigitShift = 21;

// Digit d covers bits [shift, shift + width): 11 + 11 + 10 bits.
__device__ __forceinline__ int DigitShift(int level) { return level == 0 ? 21 : (level == 1 ? 10 : 0); }
__device__ __forceinline__ std::uint32_t DigitMask(int level) {
  return level == 2 ? 0x3ffu : 0x7ffu;
}

// Float bits in an unsigned order that matches float comparison (-inf lowest).
__device__ __forceinline__ std::uint32_t OrderedBits(float x) {
  const std::uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

// Sort entry: u high, inverted key low, so one descending order is (u desc, key asc); 0 pads.
__device__ __forceinline__ std::uint64_t Entry(std::uint32_t u, std::uint32_t key) {
  return (std::uint64_t{u} << 32) | (0xffffffffu - key);
}
__device__ __forceinline__ std::uint32_t EntryU(std::uint64_t e) { return static_cast<std::uint32_t>(e >> 32); }
__device__ __forceinline__ std::uint32_t EntryKey(std::uint64_t e) {
  return 0xffffffffu - static_cast<std::uint32_t>(e);
}

// Exclusive prefix sum of `v` over the block in thread order; `total` gets the block's sum.
// Uses warp_sums[kSelectWarps + 1]; starts and ends with a barrier-safe state.
__device__ __forceinline__ int BlockExclusiveSum(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int inclusive = v;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int other = __shfl_up_sync(kFullWarpMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_sums[lane];  // kSelectWarps == kWarpSize
    int scan = s;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int other = __shfl_up_sync(kFullWarpMask, scan, offset);
      if (lane >= offset) scan += other;
    }
    warp_sums[lane] = scan - s;
    if (lane == kWarpSize - 1) warp_sums[kSelectWarps] = scan;
  }
  __syncthreads();
  const int result = warp_sums[warp] + inclusive - v;
  total = warp_sums[kSelectWarps];
  __syncthreads();  // warp_sums may be reused by the next call
  return result;
}

// The row of scores in global memory (key = index) or the candidates in shared memory.
struct RowSource {
  const float* row;
  __device__ std::uint32_t U(int i) const { return OrderedBits(row[i]); }
  __device__ std::uint32_t Key(int i) const { return static_cast<std::uint32_t>(i); }
};
struct CandidateSource {
  const std::uint64_t* entries;
  __device__ std::uint32_t U(int i) const { return EntryU(entries[i]); }
  __device__ std::uint32_t Key(int i) const { return EntryKey(entries[i]); }
};

// Block-uniform state of one query's selection. Shared so every thread reads the same values.
struct SelectState {
  std::uint32_t prefix;  // the resolved high digits of the threshold value
  std::uint32_t mask;    // the bits of `prefix` resolved so far
  int needed;            // keys still to take among those matching `prefix`
  int bucket;            // keys matching `prefix`
  int out_count;         // entries written to the output buffer
  int candidates;        // entries in the candidate buffer
  int digit_above;       // FindDigit's results
  int digit;
};

// One digit pass: the histogram of digit `level` among the keys matching the prefix, then the
// threshold digit; updates prefix, mask, needed and bucket.
template <typename Source>
__device__ void DigitPass(const Source& src, int n, int level, SelectState& st,
                          unsigned* hist, int* warp_sums) {
  const int shift = DigitShift(level);
  const std::uint32_t digit_mask = DigitMask(level);
  for (int i = threadIdx.x; i < kRadixBins; i += kSelectThreads) hist[i] = 0;
  __syncthreads();
  const std::uint32_t prefix = st.prefix, mask = st.mask;
  // Scores cluster in few bins: lanes with the same bin add once (their count), which keeps
  // same-address shared atomics from serialising a warp.
  const int lane = threadIdx.x % kWarpSize;
  for (int base = 0; base < n; base += kSelectThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const std::uint32_t u = i < n ? src.U(i) : 0u;
    const bool counted = i < n && (u & mask) == prefix;
    const std::uint32_t bin = counted ? (u >> shift) & digit_mask : 0xffffffffu;
    const unsigned peers = __match_any_sync(kFullWarpMask, bin);
    if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  // Bins in descending order: thread j holds bins 2047 - 2j (higher) and 2046 - 2j.
  const int hi_bin = kRadixBins - 1 - 2 * static_cast<int>(threadIdx.x), lo_bin = hi_bin - 1;
  const int hi_count = static_cast<int>(hist[hi_bin]), lo_count = static_cast<int>(hist[lo_bin]);
  int total;
  const int above_hi = BlockExclusiveSum(hi_count + lo_count, warp_sums, total);
  const int needed = st.needed;
  if (above_hi < needed && needed <= above_hi + hi_count) {
    st.digit = hi_bin;
    st.digit_above = above_hi;
  }
  const int above_lo = above_hi + hi_count;
  if (above_lo < needed && needed <= above_lo + lo_count) {
    st.digit = lo_bin;
    st.digit_above = above_lo;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    st.needed -= st.digit_above;
    st.bucket = static_cast<int>(hist[st.digit]);
    st.prefix |= static_cast<std::uint32_t>(st.digit) << shift;
    st.mask |= digit_mask << shift;
  }
  __syncthreads();
}

// Appends `e` to out where `take` (any lane subset; the whole warp calls): one shared atomic per
// warp instead of one per entry.
__device__ __forceinline__ void WarpAppend(bool take, std::uint64_t e, std::uint64_t* out,
                                           int* count) {
  const unsigned ballot = __ballot_sync(kFullWarpMask, take);
  if (ballot == 0) return;
  const int lane = threadIdx.x % kWarpSize;
  const int leader = __ffs(ballot) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(count, __popc(ballot));
  base = __shfl_sync(kFullWarpMask, base, leader);
  if (take) out[base + __popc(ballot & ((1u << lane) - 1u))] = e;
}

// One ordered pass: keys above the prefix go to `out` (any order: put in key order at the end); keys matching
// it are, in key order, compacted into `candidates` or, when `resolved` (every bit of the
// threshold known), the first st.needed of them go to `out`.
template <typename Source>
__device__ void CollectPass(const Source& src, int n, bool resolved, SelectState& st,
                            std::uint64_t* out, std::uint64_t* candidates, int* warp_sums) {
  const std::uint32_t prefix = st.prefix, mask = st.mask;
  const int needed = st.needed;
  int matched = 0;  // keys matching the prefix in earlier chunks (block-uniform)
  for (int base = 0; base < n; base += kSelectThreads * kSelectItems) {
    const int first = base + static_cast<int>(threadIdx.x) * kSelectItems;
    std::uint32_t u[kSelectItems];
    int matches = 0;
#pragma unroll
    for (int j = 0; j < kSelectItems; ++j) {
      const bool valid = first + j < n;
      u[j] = valid ? src.U(first + j) : 0u;
      const bool above = valid && (u[j] & mask) > prefix;
      WarpAppend(above, above ? Entry(u[j], src.Key(first + j)) : 0, out, &st.out_count);
      if (valid && (u[j] & mask) == prefix) ++matches;
    }
    int chunk_total;
    int rank = matched + BlockExclusiveSum(matches, warp_sums, chunk_total);
#pragma unroll
    for (int j = 0; j < kSelectItems; ++j) {
      const bool match = first + j < n && (u[j] & mask) == prefix;
      const std::uint64_t e = match ? Entry(u[j], src.Key(first + j)) : 0;
      if (!resolved) {
        if (match) candidates[rank] = e;
      } else {
        WarpAppend(match && rank < needed, e, out, &st.out_count);
      }
      if (match) ++rank;
    }
    matched += chunk_total;
  }
  __syncthreads();
  if (threadIdx.x == 0 && !resolved) st.candidates = matched;
  __syncthreads();
}

// Writes the keys of entries[0, take) to selected[0, take) in ascending key order (the
// contract's order: kernels/backend.h), then -1 up to top_k. No sort: the keys (all below
// `visible`, each once) set bits of a bitmap over a window of keys in free shared memory
// (`bitmap`, bitmap_words words), and a block scan of the words' population counts gives each
// word's first output slot. Keys past one window's reach take further windows (a window covers
// 32 * bitmap_words keys: 1.4 million with the usual free memory).
__device__ void WriteKeysAscending(const std::uint64_t* entries, int take, int visible, unsigned* bitmap,
                                   int bitmap_words, std::int32_t* selected, int top_k, int* warp_sums) {
  int written = 0;  // block-uniform
  for (int window = 0; window < visible; window += 32 * bitmap_words) {
    const int words = min(bitmap_words, (visible - window + 31) / 32);
    for (int i = threadIdx.x; i < words; i += kSelectThreads) bitmap[i] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < take; i += kSelectThreads) {
      const int key = static_cast<int>(EntryKey(entries[i])) - window;
      if (key >= 0 && key < 32 * words) atomicOr(&bitmap[key / 32], 1u << (key % 32));
    }
    __syncthreads();
    // Thread i owns words [i * per, (i + 1) * per): its keys follow those of lower threads.
    const int per = (words + kSelectThreads - 1) / kSelectThreads;
    const int begin = min(words, static_cast<int>(threadIdx.x) * per), end = min(words, begin + per);
    int count = 0;
    for (int w = begin; w < end; ++w) count += __popc(bitmap[w]);
    int total;
    int at = written + BlockExclusiveSum(count, warp_sums, total);
    for (int w = begin; w < end; ++w) {
      for (unsigned bits = bitmap[w]; bits != 0u; bits &= bits - 1u) {
        selected[at++] = window + 32 * w + __ffs(bits) - 1;
      }
    }
    written += total;
    __syncthreads();  // the bitmap is rewritten by the next window
  }
  for (int j = written + threadIdx.x; j < top_k; j += kSelectThreads) selected[j] = -1;
}

// A query that sees at most top_k keys selects every one of them (the reference's topk of
// min(top_k, visible)): keys 0 .. visible - 1 in order, then -1. Its scores are never read, so
// IndexerScoresKernel skips a group whose last query sees at most top_k keys. DSA layers cost
// next to nothing below top_k keys of context (GLM-5: 2048), where most chats live.
__device__ __forceinline__ void WriteAllVisibleKeys(int visible, std::int32_t* selected, int top_k) {
  for (int j = threadIdx.x; j < top_k; j += blockDim.x) selected[j] = j < visible ? j : -1;
}

// Query t's top_k of its visible (> top_k) scores by digit passes over its score row, written
// in key order: the body of IndexerSelectKernel, and the decode selection's path for rows whose
// threshold top digit holds more keys than its shared memory (indexer_decode_select.cuh).
// `smem`: the output buffer (top_k rounded up to a power of two entries), then
// `candidate_capacity` entries.
__device__ void SelectRowTopK(const IndexerTopKParams& p, int t, int visible, std::uint64_t* smem,
                              int candidate_capacity, unsigned* hist, int* warp_sums, SelectState& st) {
  const int take = p.top_k;
  int padded = 1;
  while (padded < take) padded *= 2;
  std::uint64_t* out = smem;                  // [padded]
  std::uint64_t* candidates = smem + padded;  // [candidate_capacity]
  const RowSource row{p.scores + std::int64_t{t} * (std::int64_t{p.start_pos} + p.tokens)};

  if (threadIdx.x == 0) st = {0u, 0u, take, visible, 0, 0, 0, 0};
  __syncthreads();
  {
    int level = 0;
    for (; level < 3; ++level) {
      DigitPass(row, visible, level, st, hist, warp_sums);
      if (st.bucket <= candidate_capacity) break;
    }
    const bool resolved = level >= 2;
    CollectPass(row, visible, resolved, st, out, candidates, warp_sums);
    if (!resolved) {
      const CandidateSource cands{candidates};
      const int count = st.candidates;
      for (++level; level < 3; ++level) DigitPass(cands, count, level, st, hist, warp_sums);
      CollectPass(cands, count, /*resolved=*/true, st, out, candidates, warp_sums);
    }
  }
  __syncthreads();
  // The candidate buffer is free again: it holds the bitmap.
  WriteKeysAscending(out, take, visible, reinterpret_cast<unsigned*>(candidates), 2 * candidate_capacity,
                     p.selected + std::int64_t{t} * p.top_k, p.top_k, warp_sums);
}

// grid: (tokens of this chunk); dynamic shared memory: the output buffer, then candidate_capacity entries.
// `p` describes the chunk (start_pos, tokens, selected offset to it); scores row t = query t.
__global__ void __launch_bounds__(kSelectThreads)
    IndexerSelectKernel(const __grid_constant__ IndexerTopKParams p, int candidate_capacity) {
  extern __shared__ std::uint64_t select_smem[];
  __shared__ unsigned hist[kRadixBins];
  __shared__ int warp_sums[kSelectWarps + 1];
  __shared__ SelectState st;
  const int t = blockIdx.x;
  const int visible = IndexerStart(p) + t + 1;
  if (visible <= p.top_k) {  // block-uniform, before any barrier
    WriteAllVisibleKeys(visible, p.selected + std::int64_t{t} * p.top_k, p.top_k);
    return;
  }
  SelectRowTopK(p, t, visible, select_smem, candidate_capacity, hist, warp_sums, st);
}

}  // namespace nq::kernels::cuda
