// DSA indexer top-k selection for decode (a few queries over many keys), spread over the GPU
// instead of one block per query (contract in kernels/backend.h; the prefill path is
// indexer_select.cuh). Three steps after a memset of the small counters:
//  1. IndexerScoresKernel<.., kHistogram = true> (indexer_scores.cuh) writes the scores and adds
//     each query's histogram of top digits (bits 31..21 of OrderedBits) into `top_hist`.
//  2. IndexerFilterKernel, many blocks per query: every block finds the threshold top digit d0
//     from top_hist (the digit where the count of higher digits first reaches top_k), then reads
//     its slice of the score row once: keys with a higher top digit are selected for sure
//     (`sure`), keys at d0 are candidates (`cand`), both appended at one global atomic per
//     block and list (block order is arbitrary, so the lists are in no particular key order). It also adds the candidates' second-digit histogram
//     (bits 20..10) into `second_hist`.
//  3. IndexerResolveKernel, one block per query: the second digit from second_hist, then radix
//     select over the candidates' 64-bit entries (u << 32 | ~key, indexer_select.cuh). Entries
//     are unique, so ordering by entry is the contract's ranking (score descending, lower key on
//     ties) and the selection needs no key-ordered scan: digits continue into the key bits until
//     the keys at the prefix are exactly the ones still needed. Then the survivors (the sure
//     keys and the chosen candidates, min(top_k, visible) in all) are written in key order
//     (WriteKeysAscending, indexer_select.cuh).
// Step 3 reads the candidates from global memory once in the usual case (the threshold bucket of
// 22 resolved bits fits shared memory); a degenerate row (e.g. all scores equal) takes more
// passes but stays exact.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/indexer_select.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

inline constexpr int kDecodeSelectThreads = kSelectThreads;  // BlockExclusiveSum's block size
// Score keys per filter block: kFilterItems loads in flight per thread.
inline constexpr int kFilterItems = 2;
inline constexpr int kFilterKeysPerBlock = kDecodeSelectThreads * kFilterItems;
// Entry digits: the score's 11 + 11 + 10 bits, then the inverted key's 11 + 11 + 10.
inline constexpr int kEntryLevels = 6;
inline constexpr int kEntryFirstShift = 32 + kTopDigitShift;  // 53
inline constexpr int kEntrySecondShift = 32 + 10;             // 42

// Per-query counts of the filter's appends; zeroed with the histograms.
struct DecodeSelectCounts {
  int sure;
  int cand;
  int pad[2];  // 16-byte rows
};

// Device pointers into the caller's select scratch (IndexerSelectScratchBytes), per query t:
// top_hist[t * kRadixBins], second_hist[t * kRadixBins], counts[t], sure[t * top_k],
// cand[t * cand_stride]. The histograms and counts are contiguous from top_hist (one memset).
struct DecodeSelectScratch {
  unsigned* top_hist = nullptr;
  unsigned* second_hist = nullptr;
  DecodeSelectCounts* counts = nullptr;
  std::uint64_t* sure = nullptr;
  std::uint64_t* cand = nullptr;
  std::int64_t cand_stride = 0;
};

// Digit `level` of an entry: levels 0-2 are the score's digits, 3-5 the inverted key's.
__device__ __forceinline__ int EntryShift(int level) {
  return level < 3 ? 32 + DigitShift(level) : DigitShift(level - 3);
}
__device__ __forceinline__ std::uint64_t EntryDigitMask(int level) { return DigitMask(level % 3); }

// The digit of a kRadixBins histogram (global or shared) where the count of higher digits first
// reaches `needed` (needed <= the histogram's total). Block of kDecodeSelectThreads; every thread
// gets digit, above (count of higher digits) and count (of the digit itself).
struct DigitChoice {
  int digit;
  int above;
  int count;
};
__device__ __forceinline__ DigitChoice FindThresholdDigit(const unsigned* hist, int needed,
                                                          int* warp_sums, DigitChoice& shared) {
  static_assert(kRadixBins == 2 * kDecodeSelectThreads, "each thread holds two bins");
  const int hi_bin = kRadixBins - 1 - 2 * static_cast<int>(threadIdx.x), lo_bin = hi_bin - 1;
  const int hi_count = static_cast<int>(hist[hi_bin]), lo_count = static_cast<int>(hist[lo_bin]);
  int total;
  const int above_hi = BlockExclusiveSum(hi_count + lo_count, warp_sums, total);
  if (above_hi < needed && needed <= above_hi + hi_count) shared = {hi_bin, above_hi, hi_count};
  const int above_lo = above_hi + hi_count;
  if (above_lo < needed && needed <= above_lo + lo_count) shared = {lo_bin, above_lo, lo_count};
  __syncthreads();
  const DigitChoice choice = shared;
  __syncthreads();  // `shared` may be rewritten by the next call
  return choice;
}

// grid: (ceil(visible_max / kFilterKeysPerBlock), tokens); block: kDecodeSelectThreads.
__global__ void __launch_bounds__(kDecodeSelectThreads)
    IndexerFilterKernel(const __grid_constant__ IndexerTopKParams p,
                        const __grid_constant__ DecodeSelectScratch s) {
  __shared__ unsigned second_hist[kRadixBins];
  __shared__ int warp_sums[kSelectWarps + 1];
  __shared__ DigitChoice choice_slot;
  __shared__ int base_slot[2];
  StartAsProgrammaticDependent();  // of the scores kernel
  const int t = blockIdx.y;
  const int visible = IndexerStart(p) + t + 1;
  const int first = blockIdx.x * kFilterKeysPerBlock;
  // Block-uniform, before any barrier; a query seeing at most top_k keys takes them all (resolve).
  if (first >= visible || visible <= p.top_k) return;
  const int take = p.top_k;
  const float* row = p.scores + std::int64_t{t} * (std::int64_t{p.start_pos} + p.tokens);
  // The loads go out first; the threshold digit is found while they are in flight.
  float score[kFilterItems];
#pragma unroll
  for (int j = 0; j < kFilterItems; ++j) {
    const int i = first + j * kDecodeSelectThreads + static_cast<int>(threadIdx.x);
    score[j] = i < visible ? row[i] : 0.0f;
  }
  for (int i = threadIdx.x; i < kRadixBins; i += kDecodeSelectThreads) second_hist[i] = 0;
  const int d0 =
      FindThresholdDigit(s.top_hist + t * kRadixBins, take, warp_sums, choice_slot).digit;
  // One global atomic per list per block (the lists' counters are contended by every block):
  // sure counts in the low 16 bits, candidates in the high (each <= kFilterKeysPerBlock).
  static_assert(kFilterKeysPerBlock < (1 << 16));
  std::uint32_t u[kFilterItems];
  int flags = 0;
#pragma unroll
  for (int j = 0; j < kFilterItems; ++j) {
    const int i = first + j * kDecodeSelectThreads + static_cast<int>(threadIdx.x);
    u[j] = OrderedBits(score[j]);
    const int digit = static_cast<int>(u[j] >> kTopDigitShift);
    if (i < visible && digit > d0) flags += 1;
    if (i < visible && digit == d0) {
      flags += 1 << 16;
      atomicAdd(&second_hist[(u[j] >> 10) & 0x7ffu], 1u);
    }
  }
  int block_total;
  const int offset = BlockExclusiveSum(flags, warp_sums, block_total);
  if (threadIdx.x == 0) {
    base_slot[0] = atomicAdd(&s.counts[t].sure, block_total & 0xffff);
    base_slot[1] = atomicAdd(&s.counts[t].cand, block_total >> 16);
  }
  __syncthreads();
  std::uint64_t* sure = s.sure + std::int64_t{t} * p.top_k;
  std::uint64_t* cand = s.cand + t * s.cand_stride;
  int sure_at = base_slot[0] + (offset & 0xffff), cand_at = base_slot[1] + (offset >> 16);
#pragma unroll
  for (int j = 0; j < kFilterItems; ++j) {
    const int i = first + j * kDecodeSelectThreads + static_cast<int>(threadIdx.x);
    const int digit = static_cast<int>(u[j] >> kTopDigitShift);
    const std::uint64_t e = Entry(u[j], static_cast<std::uint32_t>(i));
    if (i < visible && digit > d0) sure[sure_at++] = e;
    if (i < visible && digit == d0) cand[cand_at++] = e;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRadixBins; i += kDecodeSelectThreads) {
    if (second_hist[i] != 0) atomicAdd(&s.second_hist[t * kRadixBins + i], second_hist[i]);
  }
}

// Block-uniform state of one query's resolve step (shared).
struct ResolveState {
  std::uint64_t prefix;  // resolved high bits of the threshold entry
  std::uint64_t mask;    // the bits of `prefix` resolved so far
  int needed;            // entries still to take among those matching the prefix
  int bucket;            // entries matching the prefix
  int out_count;         // entries in the output buffer
  int cand_count;        // entries in the shared candidate buffer
};

// The state once the first two digits (the score's bits 31..21 and 20..10) are chosen: those
// bits resolved, the entries still needed among the c1 bucket. Thread 0 writes; the caller's
// barrier publishes it.
__device__ __forceinline__ void ResolveFirstTwoDigits(const DigitChoice& c0, const DigitChoice& c1, int take,
                                                      ResolveState& st) {
  st.prefix = (static_cast<std::uint64_t>(c0.digit) << kEntryFirstShift) |
              (static_cast<std::uint64_t>(c1.digit) << kEntrySecondShift);
  st.mask = (std::uint64_t{0x7ff} << kEntryFirstShift) | (std::uint64_t{0x7ff} << kEntrySecondShift);
  st.needed = take - c0.above - c1.above;
  st.bucket = c1.count;
}

// One digit pass over entries[0, n): the histogram of digit `level` among those matching the
// prefix, then its threshold digit; narrows the state to it.
__device__ void EntryDigitPass(const std::uint64_t* entries, int n, int level, ResolveState& st,
                               unsigned* hist, int* warp_sums, DigitChoice& choice_slot) {
  const int shift = EntryShift(level);
  const std::uint64_t digit_mask = EntryDigitMask(level);
  for (int i = threadIdx.x; i < kRadixBins; i += kDecodeSelectThreads) hist[i] = 0;
  __syncthreads();
  const std::uint64_t prefix = st.prefix, mask = st.mask;
  const int lane = threadIdx.x % kWarpSize;
  for (int base = 0; base < n; base += kDecodeSelectThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const std::uint64_t e = i < n ? entries[i] : 0;
    const bool counted = i < n && (e & mask) == prefix;
    const unsigned bin = counted ? static_cast<unsigned>((e >> shift) & digit_mask) : 0xffffffffu;
    // Same-bin lanes add once: matching entries crowd few bins.
    const unsigned peers = __match_any_sync(kFullWarpMask, bin);
    if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  const DigitChoice c = FindThresholdDigit(hist, st.needed, warp_sums, choice_slot);
  if (threadIdx.x == 0) {
    st.needed -= c.above;
    st.bucket = c.count;
    st.prefix |= static_cast<std::uint64_t>(c.digit) << shift;
    st.mask |= digit_mask << shift;
  }
  __syncthreads();
}

// Entries above the prefix go to `out`; those matching it to `out` when `take_matching` (all of
// them are needed) or else to `kept` (shared). Order is irrelevant: entries are unique and
// written in key order at the end. kCollectItems loads per thread go out together (the candidates are in L2).
inline constexpr int kCollectItems = 8;
__device__ void EntryCollectPass(const std::uint64_t* entries, int n, bool take_matching,
                                 ResolveState& st, std::uint64_t* out, std::uint64_t* kept) {
  const std::uint64_t prefix = st.prefix, mask = st.mask;
  for (int base = 0; base < n; base += kDecodeSelectThreads * kCollectItems) {
    std::uint64_t e[kCollectItems];
#pragma unroll
    for (int j = 0; j < kCollectItems; ++j) {
      const int i = base + j * kDecodeSelectThreads + static_cast<int>(threadIdx.x);
      e[j] = i < n ? entries[i] : 0;
    }
#pragma unroll
    for (int j = 0; j < kCollectItems; ++j) {
      const int i = base + j * kDecodeSelectThreads + static_cast<int>(threadIdx.x);
      const bool above = i < n && (e[j] & mask) > prefix;
      const bool match = i < n && (e[j] & mask) == prefix;
      WarpAppend(above || (match && take_matching), e[j], out, &st.out_count);
      WarpAppend(match && !take_matching, e[j], kept, &st.cand_count);
    }
  }
  __syncthreads();
}

// grid: (tokens); block: kDecodeSelectThreads; dynamic shared memory: the output buffer
// (min(top_k, visible_max) rounded up to a power of two entries), then `capacity` entries.
__global__ void __launch_bounds__(kDecodeSelectThreads)
    IndexerResolveKernel(const __grid_constant__ IndexerTopKParams p,
                         const __grid_constant__ DecodeSelectScratch s, int capacity) {
  extern __shared__ std::uint64_t resolve_smem[];
  __shared__ unsigned hist[kRadixBins];
  __shared__ int warp_sums[kSelectWarps + 1];
  __shared__ DigitChoice choice_slot;
  __shared__ ResolveState st;
  StartAsProgrammaticDependent();  // of the filter
  const int t = blockIdx.x;
  const int visible = IndexerStart(p) + t + 1;
  if (visible <= p.top_k) {  // block-uniform, before any barrier
    WriteAllVisibleKeys(visible, p.selected + std::int64_t{t} * p.top_k, p.top_k);
    return;
  }
  const int take = p.top_k;
  int padded = 1;
  while (padded < take) padded *= 2;
  std::uint64_t* out = resolve_smem;            // [padded]
  std::uint64_t* kept = resolve_smem + padded;  // [capacity]

  // Digits 0 and 1 from the histograms the scoring and filter kernels built.
  const DigitChoice c0 = FindThresholdDigit(s.top_hist + t * kRadixBins, take, warp_sums, choice_slot);
  const DigitChoice c1 =
      FindThresholdDigit(s.second_hist + t * kRadixBins, take - c0.above, warp_sums, choice_slot);
  if (threadIdx.x == 0) {
    ResolveFirstTwoDigits(c0, c1, take, st);
    st.out_count = 0;
    st.cand_count = 0;
  }
  __syncthreads();

  // Narrow over the global candidates until the bucket fits shared memory or is all needed.
  const std::uint64_t* cand = s.cand + t * s.cand_stride;
  const int n_cand = s.counts[t].cand;  // == c0.count
  int level = 2;
  while (st.bucket > st.needed && st.bucket > capacity && level < kEntryLevels) {
    EntryDigitPass(cand, n_cand, level++, st, hist, warp_sums, choice_slot);
  }
  const bool done = st.bucket <= st.needed;
  EntryCollectPass(cand, n_cand, done, st, out, kept);
  if (!done) {
    const int n_kept = st.cand_count;  // == st.bucket
    while (st.bucket > st.needed && level < kEntryLevels) {
      EntryDigitPass(kept, n_kept, level++, st, hist, warp_sums, choice_slot);
    }
    EntryCollectPass(kept, n_kept, /*take_matching=*/true, st, out, kept + n_kept);
  }
  // The keys above the threshold top digit; out_count + sure == take.
  const int n_sure = s.counts[t].sure;  // == c0.above
  const std::uint64_t* sure = s.sure + std::int64_t{t} * p.top_k;
  const int base = st.out_count;
  for (int i = threadIdx.x; i < n_sure; i += kDecodeSelectThreads) out[base + i] = sure[i];
  __syncthreads();
  // The kept buffer is free again: it holds the bitmap.
  WriteKeysAscending(out, take, visible, reinterpret_cast<unsigned*>(kept), 2 * capacity,
                     p.selected + std::int64_t{t} * p.top_k, p.top_k, warp_sums);
}

}  // namespace nq::kernels::cuda
