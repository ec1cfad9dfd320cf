// DSA indexer top-k selection for decode in one block per query (IndexerDecodeSelect::kOneBlock,
// kernels/cuda/indexer_topk.cuh): an alternative to indexer_decode_select.cuh's filter + resolve,
// after the same scoring kernel and its top-digit histograms; taken by default for one query
// whose row has at most kOneBlockSelectChunkKeys keys, where it measured faster on the H200
// (IndexerDecodeSelect::kAuto; bench/README.md, "DSA indexer"; tests/kernels/cuda/
// indexer_one_block_test.cu checks it selects exactly what the filter path selects). Per query:
//  1. the threshold top digit d0 from top_hist (the digit where the count of higher digits first
//     reaches top_k);
//  2. one pass over the score row (from L2): the keys at d0 go to shared memory as 64-bit entries
//     (u << 32 | ~key, indexer_select.cuh) while their second digit (bits 20..10) is counted;
//  3. the second digit, then radix digits over those entries (into the inverted key's bits when
//     scores tie) until the entries at the prefix are exactly the ones still needed: entries are
//     unique and ordered as the contract ranks keys (score descending, lower key on ties), so the
//     selection is then every key whose entry, masked to the resolved bits, is >= the prefix;
//  4. one ordered pass over the row writes those keys in ascending key order (warp ballots and a
//     block scan; no sort, no lists in global memory, no key bitmap).
// A row whose d0 bucket exceeds the shared memory (e.g. all scores equal over more keys than it
// holds) takes indexer_select.cuh's digit passes over the row instead (SelectRowTopK), exact too.
// Why try it: at decode sizes the selection is a chain of small dependent steps (ncu, 4000 keys:
// the many-block filter took 4.5 us and the one-block resolve 9.7 us, mostly barrier and L2
// latency); one block per query drops a kernel boundary, the global candidate lists and the key
// bitmap, and reads a row of up to 16384 keys once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/indexer_decode_select.cuh"
#include "kernels/cuda/indexer_select.cuh"
#include "kernels/cuda/indexer_topk.cuh"
#include "kernels/cuda/launch_dependent.cuh"
#include "kernels/cuda/reduce.cuh"

namespace nq::kernels::cuda {

// Keys a thread holds per pass over a row: a warp reads kOneBlockSelectItems x 32 consecutive
// keys, so a row of up to kOneBlockSelectChunkKeys stays in registers between the two passes.
inline constexpr int kOneBlockSelectItems = 16;
inline constexpr int kOneBlockSelectChunkKeys = kDecodeSelectThreads * kOneBlockSelectItems;

// Key j of this thread in the pass over a row chunk starting at `chunk_first`: each warp covers
// kOneBlockSelectItems x 32 consecutive keys, lane-interleaved (coalesced loads), so the keys of a
// warp's ballots are in key order item by item.
__device__ __forceinline__ int OneBlockSelectKey(int chunk_first, int j) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  return chunk_first + warp * (kWarpSize * kOneBlockSelectItems) + j * kWarpSize + lane;
}

// The order bits of this thread's keys of a chunk (0 past `visible`; callers test the key).
__device__ __forceinline__ void LoadRowChunk(const float* row, int chunk_first, int visible,
                                             std::uint32_t (&u)[kOneBlockSelectItems]) {
#pragma unroll
  for (int j = 0; j < kOneBlockSelectItems; ++j) {
    const int i = OneBlockSelectKey(chunk_first, j);
    u[j] = i < visible ? OrderedBits(row[i]) : 0u;
  }
}

// Step 2 for one chunk: the keys at top digit d0 to `bucket` (shared, unordered) as entries, and
// their second digits counted in `hist` (shared).
__device__ __forceinline__ void CollectThresholdBucket(const std::uint32_t (&u)[kOneBlockSelectItems],
                                                       int chunk_first, int visible, int d0, unsigned* hist,
                                                       std::uint64_t* bucket, int* bucket_count) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int j = 0; j < kOneBlockSelectItems; ++j) {
    const int i = OneBlockSelectKey(chunk_first, j);
    const bool in = i < visible && static_cast<int>(u[j] >> kTopDigitShift) == d0;
    if (__ballot_sync(kFullWarpMask, in) == 0u) continue;  // warp-uniform
    // Same-bin lanes add once: the bucket's keys crowd few second digits.
    const unsigned bin = in ? (u[j] >> 10) & 0x7ffu : 0xffffffffu;
    const unsigned peers = __match_any_sync(kFullWarpMask, bin);
    if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
    WarpAppend(in, Entry(u[j], static_cast<std::uint32_t>(i)), bucket, bucket_count);
  }
}

// Step 4 for one chunk: writes its selected keys (entry masked to `mask` >= prefix) in key order
// from selected[written]; returns how many (block-uniform).
__device__ __forceinline__ int WriteSelectedChunk(const std::uint32_t (&u)[kOneBlockSelectItems], int chunk_first,
                                                  int visible, std::uint64_t prefix, std::uint64_t mask,
                                                  int written, std::int32_t* selected, int* warp_sums) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  unsigned ballot[kOneBlockSelectItems];
  int warp_count = 0;
#pragma unroll
  for (int j = 0; j < kOneBlockSelectItems; ++j) {
    const int i = OneBlockSelectKey(chunk_first, j);
    const bool take = i < visible && (Entry(u[j], static_cast<std::uint32_t>(i)) & mask) >= prefix;
    ballot[j] = __ballot_sync(kFullWarpMask, take);
    warp_count += __popc(ballot[j]);
  }
  // Lane 0 carries its warp's count: the exclusive sum in thread order is the warp's first slot.
  int total;
  const int warp_first = BlockExclusiveSum(lane == 0 ? warp_count : 0, warp_sums, total);
  int at = written + __shfl_sync(kFullWarpMask, warp_first, 0);
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kOneBlockSelectItems; ++j) {
    if ((ballot[j] >> lane) & 1u) selected[at + __popc(ballot[j] & lanes_below)] = OneBlockSelectKey(chunk_first, j);
    at += __popc(ballot[j]);
  }
  return total;
}

// grid: (tokens); block: kDecodeSelectThreads; dynamic shared memory: kSelectDynamicSmemBytes
// (indexer_topk.cu), the threshold bucket's `bucket_capacity` entries, or SelectRowTopK's output
// buffer and `row_capacity` candidates. kRowInRegisters: every row fits one chunk
// (start_pos + tokens <= kOneBlockSelectChunkKeys), read once for both passes.
template <bool kRowInRegisters>
__global__ void __launch_bounds__(kDecodeSelectThreads)
    IndexerOneBlockSelectKernel(const __grid_constant__ IndexerTopKParams p, const unsigned* top_hist,
                              int bucket_capacity, int row_capacity) {
  extern __shared__ std::uint64_t one_block_smem[];
  __shared__ unsigned hist[kRadixBins];
  __shared__ int warp_sums[kSelectWarps + 1];
  __shared__ DigitChoice choice_slot;
  __shared__ ResolveState st;
  __shared__ SelectState row_state;
  StartAsProgrammaticDependent();  // of the scores kernel
  const int t = blockIdx.x;
  const int visible = IndexerStart(p) + t + 1;
  std::int32_t* selected = p.selected + std::int64_t{t} * p.top_k;
  if (visible <= p.top_k) {  // block-uniform, before any barrier
    WriteAllVisibleKeys(visible, selected, p.top_k);
    return;
  }
  const int take = p.top_k;
  const float* row = p.scores + std::int64_t{t} * (std::int64_t{p.start_pos} + p.tokens);
  std::uint32_t u[kOneBlockSelectItems];
  if constexpr (kRowInRegisters) LoadRowChunk(row, 0, visible, u);  // in flight while d0 is found

  const DigitChoice c0 = FindThresholdDigit(top_hist + t * kRadixBins, take, warp_sums, choice_slot);
  if (c0.count > bucket_capacity) {  // block-uniform
    SelectRowTopK(p, t, visible, one_block_smem, row_capacity, hist, warp_sums, row_state);
    return;
  }
  for (int i = threadIdx.x; i < kRadixBins; i += kDecodeSelectThreads) hist[i] = 0;
  if (threadIdx.x == 0) st.cand_count = 0;
  __syncthreads();
  std::uint64_t* bucket = one_block_smem;
  for (int first = 0; first < visible; first += kOneBlockSelectChunkKeys) {
    if constexpr (!kRowInRegisters) LoadRowChunk(row, first, visible, u);
    CollectThresholdBucket(u, first, visible, c0.digit, hist, bucket, &st.cand_count);
  }
  __syncthreads();
  const DigitChoice c1 = FindThresholdDigit(hist, take - c0.above, warp_sums, choice_slot);
  if (threadIdx.x == 0) ResolveFirstTwoDigits(c0, c1, take, st);
  __syncthreads();
  const int n_bucket = st.cand_count;  // == c0.count
  for (int level = 2; st.bucket > st.needed && level < kEntryLevels; ++level) {
    EntryDigitPass(bucket, n_bucket, level, st, hist, warp_sums, choice_slot);
  }
  // st.bucket == st.needed: exactly `take` entries are >= the prefix in the resolved bits.
  const std::uint64_t prefix = st.prefix, mask = st.mask;
  int written = 0;
  for (int first = 0; first < visible; first += kOneBlockSelectChunkKeys) {
    if constexpr (!kRowInRegisters) LoadRowChunk(row, first, visible, u);
    written = WriteSelectedChunk(u, first, visible, prefix, mask, written, selected, warp_sums) + written;
  }
}

}  // namespace nq::kernels::cuda
