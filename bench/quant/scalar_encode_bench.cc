// scalar_encode_bench: what per-matrix codebook refits cost and buy in a nested_scalar_v1 encode
// (nq encode --codebook_refinements). Encodes one rows x cols N(0,1) matrix with 0..max refits,
// one thread, under the AR(1) 0.9 Hessian (correlated inputs, as real layer inputs are: LDLQ, what
// `nq encode --calib` runs) or without one (--hessian 0: plain rounding, how models too large to
// calibrate are encoded), and prints for each the seconds per matrix and the relative output error
// ||X (W - W_hat)^T|| / ||X W^T|| at 2 and 4 bits (through the AR(1) Hessian either way).
//
//   scalar_encode_bench [--rows 2048] [--cols 7168] [--max_refinements 2] [--rounds 1] [--hessian 1]
//
// 2048 x 7168 is a DeepSeek-V3 / GLM-5 expert's gate or up projection (rows: the expert width).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "services/quant/codec_bench.h"
#include "services/quant/ldlq.h"
#include "services/quant/nested_scalar_codec.h"

int main(int argc, char** argv) {
  int64_t rows = 2048, cols = 7168;
  int max_refinements = 2, rounds = 1, hessian = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const long long v = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rows")) rows = v;
    else if (!std::strcmp(argv[i], "--cols")) cols = v;
    else if (!std::strcmp(argv[i], "--max_refinements")) max_refinements = static_cast<int>(v);
    else if (!std::strcmp(argv[i], "--rounds")) rounds = static_cast<int>(v);
    else if (!std::strcmp(argv[i], "--hessian")) hessian = static_cast<int>(v);
    else {
      std::fprintf(stderr,
                   "usage: scalar_encode_bench [--rows N] [--cols N] [--max_refinements N] [--rounds N] "
                   "[--hessian 0|1]\n");
      return 2;
    }
  }
  if (rows <= 0 || cols <= 0 || rows % 128 != 0 || cols % 128 != 0 || max_refinements < 0 || rounds < 1 ||
      (hessian != 0 && hessian != 1)) {
    std::fprintf(stderr, "scalar_encode_bench: rows and cols must be positive multiples of 128 (the rotation "
                         "blocks), max_refinements >= 0, rounds >= 1, hessian 0 or 1\n");
    return 2;
  }
  const std::vector<float> w = nq::quant::GaussianValues(rows * cols, 11);
  const nq::quant::Hessian h = nq::quant::Ar1Hessian(cols, 0.9);
  const nq::quant::NestedScalarCodec codec;
  std::vector<float> decoded(w.size());
  for (int refinements = 0; refinements <= max_refinements; ++refinements) {
    nq::quant::EncodeOptions options;
    options.codebook_refinements = refinements;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto m = codec.Encode(w, rows, cols, hessian ? &h : nullptr, options);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!m.ok()) {
        std::fprintf(stderr, "encode failed: %s\n", m.status().ToString().c_str());
        return 1;
      }
      double error[2] = {};
      const nq::quant::Precision precisions[2] = {nq::quant::Precision::k2Bit, nq::quant::Precision::k4Bit};
      for (int p = 0; p < 2; ++p) {
        const absl::Status decode = codec.Decode(*m, precisions[p], decoded);
        const absl::StatusOr<double> e =
            decode.ok() ? nq::quant::RelativeOutputError(w, decoded, rows, cols, h) : absl::StatusOr<double>(decode);
        if (!e.ok()) {
          std::fprintf(stderr, "measuring failed: %s\n", e.status().ToString().c_str());
          return 1;
        }
        error[p] = *e;
      }
      std::printf("%lld x %lld, %s, %d refinement(s), round %d: %.2f s per matrix, relative output error %.5f "
                  "(2-bit) %.5f (4-bit)\n",
                  static_cast<long long>(rows), static_cast<long long>(cols),
                  hessian ? "LDLQ (AR(1) 0.9)" : "no Hessian", refinements, r + 1, s, error[0], error[1]);
    }
  }
  return 0;
}
