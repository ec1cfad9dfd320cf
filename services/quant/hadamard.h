// Random-sign Walsh-Hadamard rotations (DESIGN.md section 6).
//
// A rotation of width n with block b (a power of two dividing n) and sign seed s maps a
// vector v to y = blockdiag(H_b) * diag(signs_s) * v, where H_b is the normalised
// Walsh-Hadamard matrix (H_b^T = H_b, H_b * H_b = I). It is orthogonal; its inverse is
// v = diag(signs_s) * blockdiag(H_b) * y. Signs come from our own splitmix64 stream so a
// release decodes bit-identically on every platform.
//
// A weight matrix W (rows x cols, row-major) is rotated on both sides:
//   W' = R_rows * W * R_cols^T
// i.e. every column (length rows) gets R_rows and every row (length cols) gets R_cols.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace nq::quant {

// Supported Hadamard block widths: 16 up to 4096 (the widest per-layer block DESIGN.md allows,
// e.g. 512 on down_proj). Real models use 128 and wider (nq encode takes the widest block up
// to 128, or 512 on down_proj's input, that divides the dimension); the narrow ones exist for
// the tiny test models, whose experts are 64 x 16.
inline constexpr int64_t kMinHadamardBlock = 16;
// The block both sides use unless told otherwise (DESIGN.md section 6).
inline constexpr int64_t kDefaultHadamardBlock = 128;
inline constexpr int64_t kMaxHadamardBlock = 4096;

// One splitmix64 step (Steele, Lea, Flood 2014): a fixed, portable 64-bit mixer.
uint64_t SplitMix64(uint64_t& state);

// n random signs (+1.0f / -1.0f) from `seed`, one bit of splitmix64 output each.
std::vector<float> RandomSigns(uint64_t seed, int64_t n);

// In-place normalised fast Walsh-Hadamard transform (Sylvester ordering) of `x`, whose
// size must be a power of two. Scaled by 1/sqrt(n) so that applying it twice is identity.
void FwhtInPlace(std::span<float> x);

// Checks that `block` is a power of two in [kMinHadamardBlock, kMaxHadamardBlock] and
// divides `n`. `what` names the dimension in the error ("cols").
absl::Status ValidateHadamardBlock(int64_t n, int64_t block, const char* what);

// Rotates `x` (size n, a multiple of block) in place: x <- blockdiag(H) * diag(signs) * x.
// `signs` must have size n. Contract checked by the caller (ValidateHadamardBlock).
void RotateVector(std::span<float> x, std::span<const float> signs, int64_t block);
// Exact inverse of RotateVector: x <- diag(signs) * blockdiag(H) * x.
void UnrotateVector(std::span<float> x, std::span<const float> signs, int64_t block);

// The two-sided rotation parameters of one matrix.
struct RotationParams {
  int64_t row_block = kDefaultHadamardBlock;
  int64_t col_block = kDefaultHadamardBlock;
  uint64_t row_sign_seed = 0;
  uint64_t col_sign_seed = 0;
};

// W <- R_rows * W * R_cols^T for row-major W (rows x cols). Validates the blocks.
absl::Status RotateMatrix(std::span<float> w, int64_t rows, int64_t cols,
                          const RotationParams& params);
// W <- R_rows^T * W * R_cols, the exact inverse of RotateMatrix.
absl::Status UnrotateMatrix(std::span<float> w, int64_t rows, int64_t cols,
                            const RotationParams& params);

// H <- R * H * R^T for a symmetric dim x dim matrix (row-major, double), R the rotation of
// width dim with `block` and `seed`. Used to carry a Hessian into the rotated domain.
absl::Status RotateSymmetric(std::span<double> h, int64_t dim, int64_t block, uint64_t seed);

}  // namespace nq::quant
