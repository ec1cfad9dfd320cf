// Random NestQuant MoE layers for the NqMoe op's tests and benchmark: packed codes, scales,
// level tables and rotations as nq encode lays them out, uploaded to any backend with a slot
// arena holding the residual planes of the experts chosen to run at 4 bits.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace nq::kernels::testing {

struct NqProjectionHost {
  std::int64_t rows = 0, cols = 0;
  std::vector<std::uint8_t> base;      // [E][rows * cols / 4]
  std::vector<std::uint8_t> residual;  // [E][rows * cols / 4]
  std::vector<float> row_scales, col_scales;
  std::vector<float> levels;  // nested_scalar_v1: [E][kNqLevelTable]
  std::vector<float> gains;   // trellis_v1: [E][cols / 16][2] (base, residual)
  // Low-rank corrections (kernels/nq_moe.h), empty where this projection has none: the resident
  // factors U_b [E][rows][R] and V_b [E][R][cols], and the residual level's U_r, V_r of the same
  // shapes (values on the fp16 grid: the slot record holds them as fp16).
  std::vector<float> lowrank_u, lowrank_v, lowrank_u4, lowrank_v4;
};

struct NqMoeHost {
  NqCodec codec = NqCodec::kNestedScalar;
  std::int64_t hidden = 0, intermediate = 0, num_experts = 0;
  NqProjectionHost gate, up, down;
  std::vector<float> input_signs, gate_row_signs, down_col_signs, down_row_signs;
  std::int64_t input_block = 0, gate_row_block = 0, down_col_block = 0, down_row_block = 0;
  std::int64_t lowrank_rank = 0;  // R, 0 without low-rank corrections
};

// Codes uniform, scales and levels like a rotated, scaled real expert (levels near the
// Gaussian 2-bit design, 4-bit levels nested inside each base cell). Even-numbered experts have
// base levels on an even grid (what nq encode writes by default), odd ones free levels, so the
// GPU's two 2-bit decodes both run.
NqMoeHost RandomNqMoe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate, std::int64_t experts);

// The same for trellis_v1 (hidden and intermediate multiples of 16): uniform tile bits (every
// state equally likely, as the Viterbi search's output is near enough) and per-column-block gains
// like an encode of N(0, 1) targets (base near 1, residual near the base's error RMS).
NqMoeHost RandomTrellisNqMoe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate,
                             std::int64_t experts);

// Random low-rank factors of rank R on gate and up (gate_up) and/or down, sized so that the
// correction moves each projection's output by about a quarter of its RMS at either level.
// Every third expert (e % 3 == 2) gets zero factors, as an expert the encoder left alone.
void AddRandomLowRank(std::mt19937_64& rng, NqMoeHost& host, std::int64_t rank, bool gate_up, bool down);

// The layer on `backend`: slot_of_expert[e] >= 0 puts expert e's residuals in that slot.
// Projections with low-rank factors get them uploaded, their residual-level factors in each
// slot's record after the residual planes (fp16, quant::PackLowRank's layout).
// scattered_slots: the records lie in reverse slot order with a record-sized gap before each,
// reached through NqSlots::slot_records (slots lent by the free KV cache, issue #23).
struct NqMoeDevice {
  NqMoeWeights weights;
  Tensor slot_table;
  Tensor arena;
  Tensor slot_records;
  NqSlots slots;
};
NqMoeDevice UploadNqMoe(Backend& backend, const NqMoeHost& host, std::span<const std::int32_t> slot_of_expert,
                        bool scattered_slots = false);

// top_k distinct experts per token with weights in [0.1, 1): each token draws from the first
// `pool` experts (pool < experts makes the tokens of a chunk share experts).
struct NqMoeRouting {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};
NqMoeRouting RandomNqMoeRouting(std::mt19937_64& rng, std::int64_t tokens, std::int64_t top_k, std::int64_t experts,
                                std::int64_t pool);

// A slot table by mode: 0 every expert at 2 bits, 1 every expert in a slot (4 bits), 2 a random
// half; slots numbered in expert order.
std::vector<std::int32_t> NqMoeSlots(std::mt19937_64& rng, std::int64_t experts, int mode);

// backend.NqMoe of the layer over x (tokens x hidden); a failure is a test failure and returns {}.
std::vector<float> RunNqMoe(Backend& backend, const NqMoeHost& host, std::span<const std::int32_t> slot_of_expert,
                            const std::vector<float>& x, const NqMoeRouting& routing, std::int64_t top_k,
                            bool scattered_slots = false);

// The dense result, independent of the op's code path: each expert's weights dequantised and
// unrotated into dense matrices W = R_rows^T W' R_cols (rotations as dense matrices), then
// sum_k w_k * down(silu(gate x) * up x) in double.
std::vector<double> DenseNqMoeReference(const NqMoeHost& host, std::span<const float> x,
                                        std::span<const std::int32_t> ids, std::span<const float> weights,
                                        std::int64_t top_k, std::span<const std::int32_t> slot_of_expert);

}  // namespace nq::kernels::testing
